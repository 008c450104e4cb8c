"""The soak drill's verdict on each job: finished, running, restorable, or lost, and for a lost
job the path that lost it, from its own report and the daemon's events around its end:

- `enomem`: a system call failed with ENOMEM at the cgroup's limit and the job exited (exit
  status 12; the hog says which call, write(2) of its data file or of its log, where it could
  still write that down);
- `oom-killed`: the kernel's OOM killer took it (SIGKILL, an OOM kill counted in its cgroup,
  no checkpoint);
- `killed`: SIGKILL without a checkpoint or an OOM kill counted;
- `exited N`: any other end without its "done" line.

Each loss carries what was going on in its cgroup when it ended: `after restart` (within
RESTART_WINDOW of a daemon SIGKILL), `during dump of PID` (another job of the same cgroup was
stopped and being dumped), `after park release` (the park watchdog had handed the cgroup to the
OOM killer)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import event_time

ENOMEM_EXIT = 12  # tests/workloads/hog.py exits with the errno of a failed system call
RESTART_WINDOW = 5.0  # seconds after a daemon SIGKILL that a loss counts as "after restart"
HANDLING_MARGIN = 0.5  # seconds around another job's handling that still count as during it


@dataclass
class Ending:
    """How a job that did not finish ended, and what was happening in its cgroup then."""

    cause: str  # enomem | oom-killed | killed | exited N
    detail: str = ""
    context: list[str] = field(default_factory=list)

    def words(self) -> str:
        where = f" ({self.detail})" if self.detail else ""
        around = f"; {', '.join(self.context)}" if self.context else "; nothing else going on"
        return f"{self.cause}{where}{around}"


@dataclass(frozen=True)
class Handling:
    """One victim handled by the daemon: stopped at `began`, dumped (or thawed) by `ended`."""

    cgroup: str
    pid: int
    began: float
    ended: float


def handlings(events: list[dict[str, Any]]) -> list[Handling]:
    """Every victim.frozen paired with the checkpoint.done / checkpoint.failed / victim.thawed
    that followed it for the same pid (a daemon killed meanwhile: until the next start)."""
    found: list[Handling] = []
    open_: dict[int, tuple[str, float]] = {}
    for event in events:
        name = event.get("event")
        pid = event.get("pid")
        if name == "guard.started":
            for held, (cgroup, began) in open_.items():
                found.append(Handling(cgroup, held, began, event_time(event)))
            open_.clear()
        if not isinstance(pid, int):
            continue
        if name == "victim.frozen":
            open_[pid] = (str(event.get("cgroup")), event_time(event))
        elif name in ("checkpoint.done", "checkpoint.failed", "victim.thawed",
                      "victim.gone") and pid in open_:
            cgroup, began = open_.pop(pid)
            found.append(Handling(cgroup, pid, began, event_time(event)))
    return found


def ending(code: int | None, err_text: str, ended_at: float, cgroup: str, pid: int,
           restarts: Iterable[float], handled: list[Handling],
           events: list[dict[str, Any]]) -> Ending:
    """How one job that is neither done, running nor restorable ended (`ended_at`: wall-clock
    time of its last sign of life)."""
    line = next((ln for ln in err_text.splitlines() if ln.startswith("hog: error")), "")
    oom_kills = [e for e in events if e.get("event") in ("oom.kill_seen", "oom.released")
                 and e.get("cgroup") == cgroup]
    if code == ENOMEM_EXIT or line:
        out = Ending("enomem" if code == ENOMEM_EXIT or "ENOMEM" in line
                     else f"error exit {code}",
                     line.removeprefix("hog: error ").split(":")[0] or "unreported: the "
                     "hog could not write its report either")
    elif code == -9 and any(e.get("event") == "oom.kill_seen" for e in oom_kills):
        out = Ending("oom-killed")
    elif code == -9:
        out = Ending("killed", "SIGKILL, no checkpoint, no OOM kill counted")
    else:
        out = Ending(f"exited {code}")
    for at in restarts:
        if 0 <= ended_at - at <= RESTART_WINDOW:
            out.context.append(f"after restart (+{ended_at - at:.1f}s)")
    for other in handled:
        if other.cgroup == cgroup and other.pid != pid and \
                other.began - HANDLING_MARGIN <= ended_at <= other.ended + HANDLING_MARGIN:
            out.context.append(f"during dump of {other.pid}")
    released = [e for e in oom_kills if e.get("event") == "oom.released"
                and event_time(e) <= ended_at + HANDLING_MARGIN]
    if released:
        out.context.append("after park release")
    return out


def last_sign_of_life(*paths: Path) -> float:
    """The newest modification time among a job's files (its log, its stderr): when it last
    wrote, which is when it ended for a job that did not finish."""
    times = []
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)


def restart_gaps(restarts: list[float], events: list[dict[str, Any]]) -> list[float]:
    """For each daemon SIGKILL: seconds until the next daemon said every guard was armed
    (guard.ready): the time nothing could act on a crossing."""
    ready = sorted(event_time(e) for e in events if e.get("event") == "guard.ready")
    gaps = []
    for killed in restarts:
        after = [at for at in ready if at >= killed]
        if after:
            gaps.append(round(after[0] - killed, 3))
    return gaps


EVIDENCE_BEFORE = 30.0  # seconds of the daemon's events before a lost job's end that are kept
EVIDENCE_AFTER = 5.0
EVIDENCE_FIELDS = ("pid", "step", "then", "outcome", "reason", "error", "detail", "limit_busy",
                   "usage", "limit", "explanation")


def evidence(events: list[dict[str, Any]], cgroup: str, pid: int, ended_at: float,
             most: int = 40) -> list[str]:
    """The daemon's events about a lost job's cgroup or its pid around its end, one line each
    (seconds from its end, the event, its telling fields): what the drill's table shows
    under the loss, so that a run whose logs are gone (the lane's disk) still says why."""
    lines = []
    for event in events:
        if event.get("cgroup") != cgroup and event.get("pid") != pid:
            continue
        try:
            at = event_time(event) - ended_at
        except (KeyError, ValueError):
            continue
        if -EVIDENCE_BEFORE <= at <= EVIDENCE_AFTER:
            said = ", ".join(f"{k}={str(event[k])[:160]}" for k in EVIDENCE_FIELDS
                             if event.get(k) not in (None, ""))
            lines.append(f"{at:+.2f}s {event.get('event')}: {said}")
    return lines[-most:]


def oom_evidence(events: list[dict[str, Any]], cgroup: str) -> list[str]:
    """The daemon's events about a cgroup where the kernel's OOM killer acted, around the
    daemon's last `oom.kill_seen` there (or its last event there, where it saw none): which
    process went is not in the cgroup's counter, so the drill keeps what led to it."""
    own = [e for e in events if e.get("cgroup") == cgroup]
    seen = [e for e in own if e.get("event") == "oom.kill_seen"] or own[-1:]
    if not seen:
        return []
    try:
        at = event_time(seen[-1])
    except (KeyError, ValueError):
        return []
    return evidence(events, cgroup, -1, at)
