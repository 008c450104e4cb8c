"""What the standby (oomguard/daemon/standby.py) does once the daemon is gone: read every
guarded cgroup every POLL_S, and stop the processes of one whose resident memory has reached its
level (or whose tasks wait at the limit), recorded in the frozen ledger first; until the next
daemon relieves it (SIGTERM: it ends and leaves them to that daemon), or the guards'
park_deadline passes (it continues them, puts back oom_kill_disable as the user had it, ends).

Light on purpose (no structlog, no CRIU, no process events): it sits idle beside the daemon for
its whole life. Its log lines are JSON, as the daemon's."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from oomguard.act.bystanders import Bystanders, Held
from oomguard.cgroup.base import parse_flat_keyed
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.watch import OOM_KILL_KEY, put_back_saved
from oomguard.daemon.standby import POLL_S, Watched
from oomguard.model.errors import CgroupGone
from oomguard.sense.procfs import ProcReader
from oomguard.store.ledger import FrozenLedger, SavedLimits


class JsonLog:
    """The daemon's JSON log lines (event, level, timestamp), without structlog."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr

    def _line(self, level: str, event: str, fields: dict[str, Any]) -> None:
        stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(json.dumps({**fields, "event": event, "level": level,
                                          "timestamp": stamp}) + "\n")
            self.stream.flush()

    def info(self, event: str, **fields: Any) -> None:
        self._line("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._line("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._line("error", event, fields)


def over_level(path: Path, level: int) -> tuple[bool, int]:
    """Whether the cgroup's resident memory (usage less page cache) has reached `level`, or
    its tasks wait at the limit; and the usage read. Usage is read first, alone: below the
    level nothing else is (every POLL_S, for every cgroup). Raises OSError, CgroupGone."""
    try:
        usage = int((path / "memory.usage_in_bytes").read_text())
        if usage < level:
            return False, usage
        stat = parse_flat_keyed((path / "memory.stat").read_text())
        oom = parse_flat_keyed((path / "memory.oom_control").read_text())
    except FileNotFoundError as exc:
        raise CgroupGone(f"cgroup {path} is gone") from exc
    resident = max(stat.get("total_rss", 0), usage - stat.get("total_cache", 0))
    return resident >= level or bool(oom.get("under_oom", 0)), usage


class StandbyGuard:
    def __init__(self, ledger: Path, saved: Path, log: Any, *,
                 proc: ProcReader | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 self_pid: int | None = None) -> None:
        self.proc = proc or ProcReader()
        self.ledger = FrozenLedger(ledger, self.proc)
        self.saved = SavedLimits(saved)
        self.holding = Bystanders(self.proc, self.ledger, self_pid=self_pid)
        self.log = log
        self.clock = clock
        self.relieved = threading.Event()

    def run(self, watched: list[Watched]) -> int:
        """Guard `watched` until relieved (SIGTERM) or past their deadline."""
        signal.signal(signal.SIGTERM, lambda signum, frame: self.relieved.set())
        began = self.clock()
        deadline = max(w.deadline for w in watched)
        self.log.warning("standby.guarding", cgroups=len(watched),
                         explanation="the daemon is gone: processes of a cgroup whose resident "
                         "memory reaches its threshold are stopped until the next start")
        held: dict[Path, Held] = {}
        while not self.relieved.is_set() and self.clock() - began < deadline:
            self.round(watched, held)
            self.relieved.wait(POLL_S)
        if self.relieved.is_set():
            self.log.info("standby.relieved", held=sum(len(h.pids) for h in held.values()),
                          explanation="a new daemon takes over: what was stopped is its to "
                          "continue")
            return 0
        self.give_up(watched, held, deadline)
        return 0

    def round(self, watched: list[Watched], held: dict[Path, Held]) -> None:
        for one in watched:
            if one.path in held:
                continue
            try:
                over, usage = over_level(one.path, one.level)
            except (OSError, CgroupGone, ValueError):
                continue
            if not over:
                continue
            cgroup = V1MemoryCgroup(one.path, one.mount)
            stopped = self.holding.hold(cgroup, ())
            if not stopped.pids:
                continue  # nothing to stop (yet): read again next round
            held[one.path] = stopped
            self.log.warning("standby.held", cgroup=str(one.path), pids=stopped.pids,
                             usage=usage, threshold_bytes=one.level,
                             explanation="its resident memory reached the threshold while no "
                             "daemon runs: stopped until the next start")

    def give_up(self, watched: list[Watched], held: dict[Path, Held], deadline: float) -> None:
        """No daemon came: continue what was stopped, and hand the cgroups back to the
        kernel as they were before oomguard (oom_kill_disable as the user had it)."""
        continued = sorted(pid for stopped in held.values() for pid in stopped.pids)
        for stopped in held.values():
            self.holding.release(stopped)
        originals = self.saved.items()
        forgotten = []
        for one in watched:
            key = str(one.path) + OOM_KILL_KEY
            if key not in originals:
                continue
            with contextlib.suppress(OSError, CgroupGone, ValueError):
                put_back_saved(V1MemoryCgroup(one.path, one.mount), key, originals[key])
                forgotten.append(key)
        self.saved.forget_many(forgotten)
        self.log.error("standby.gave_up", after_seconds=deadline, continued=continued,
                       settings_restored=[k.removesuffix(OOM_KILL_KEY) for k in forgotten],
                       explanation="no daemon started within park_deadline: what the standby "
                       "stopped runs again, and the kernel handles these cgroups as it would "
                       "without oomguard")
