"""Side by side on a workstation host (issue 27, item 7): the kernel alone, Debian's earlyoom,
systemd-oomd and oomguard, one after another, on the same hogs, inside the host lane's guest
(Debian bookworm, systemd as PID 1, cgroup v2; scripts/bench-host runs it there).

Every run gets a fresh slice, `MemoryMax=256M` with `ManagedOOMMemoryPressure=kill` (40%,
systemd-oomd's window cut to 5 s: its best case), the same for every guard. A placeholder unit
makes the slice exist before the hogs start, and each guard watches it (oomguard's glob rule
has armed it) before they do. Per guard and hog, this records:

- what became of the job: `checkpointed` (and whether `oomguard restore` brought it back to
  finish its count with its memory intact), `killed` and by whom (the kernel's OOM killer,
  earlyoom or systemd-oomd, from their journals and the unit's Result=), `finished` or
  `running`;
- the time from the threshold (the slice's usage first seen at 70% of its limit by a sampler
  polling every 5 ms) to the first action on the job (a task stopped or frozen, or gone).

Stdlib only: the guest's python3 runs it, as root. Not a test: tests/integration/
test_host_sidebyside.py runs a short selection of it and checks its outcomes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
HOG = REPO / "tests" / "workloads" / "hog.py"
POPULATE = REPO / "tests" / "workloads" / "populate.py"
CGROOT = Path("/sys/fs/cgroup")
MiB = 1 << 20
T = TypeVar("T")
LIMIT = 256 * MiB
THRESHOLD = 0.70
POLL = 0.005
GUARDS = ("kernel", "earlyoom", "systemd-oomd", "oomguard")
SERVICES = {"earlyoom": "earlyoom.service", "systemd-oomd": "systemd-oomd.service",
            "oomguard": "oomguard.service"}
OOMGUARD_CONFIG = """[daemon]
rescan_interval = "1s"
store_max_size = "80%"
store_keep_free = "5%"

[[guard]]
cgroups = ["/sys/fs/cgroup/sbs*.slice"]
threshold = "70%"
"""


@dataclass(frozen=True)
class Hog:
    """One scenario: the jobs started together in one slice (argv of each, by its log)."""

    name: str
    jobs: tuple[tuple[str, ...], ...]  # argv templates: "{log}" is the job's log


def hog(target: int, rate: float) -> tuple[str, ...]:
    steps = target // 4 + 40  # grown, then 40 ticks of 0.05 s, then "done N ok"
    return ("python3", str(HOG), "--log", "{log}", "--target", str(target), "--rate", str(rate),
            "--count", str(steps))


HOGS = {
    "100mbs": Hog("100 MB/s to 400 MiB", (hog(400, 100),)),
    "unthrottled": Hog("unthrottled to 400 MiB", (hog(400, 100_000),)),
    "populate": Hog("MAP_POPULATE of 400 MiB", (("python3", str(POPULATE), "{log}", "400"),)),
    "two": Hog("two hogs in one slice, 100 MB/s to 200 MiB each",
               (hog(200, 100), hog(200, 100))),
}


@dataclass
class Run:
    guard: str
    hog: str
    outcome: list[str] = field(default_factory=list)  # per job
    cross_s: float | None = None  # monotonic
    action_s: float | None = None
    restored: list[str] = field(default_factory=list)  # per checkpointed job: ok / why not
    # oomguard's and systemd-oomd's journal since the run began, where oomguard saved not
    # every job: what it saw and did (the lane's journal goes with the VM).
    evidence: list[str] = field(default_factory=list)

    @property
    def to_action(self) -> float | None:
        if self.cross_s is None or self.action_s is None:
            return None
        return max(0.0, self.action_s - self.cross_s)


def sh(*argv: str, check: bool = False, timeout: float = 120) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip()


def wait_for(test: Callable[[], T], timeout: float, step: float = 0.1) -> T:
    end = time.monotonic() + timeout
    while True:
        got = test()
        if got or time.monotonic() > end:
            return got
        time.sleep(step)


def journal_lines(unit: str, since: str) -> list[str]:
    text = sh("journalctl", "-q", "-u", unit, "--since", since, "-o", "short-precise",
              "--no-pager")
    return [line for line in text.splitlines() if line.strip()]


def journal_count(unit: str, grep: str, since: str) -> int:
    text = sh("journalctl", "-q", "-u", unit, "--since", since, "-o", "cat", "--no-pager")
    return sum(1 for line in text.splitlines() if grep in line)


def set_up_guards() -> None:
    Path("/etc/systemd/oomd.conf.d").mkdir(parents=True, exist_ok=True)
    Path("/etc/systemd/oomd.conf.d/sidebyside.conf").write_text(
        "[OOM]\nDefaultMemoryPressureDurationSec=5s\n")
    Path("/etc/oomguard/oomguard.toml").write_text(OOMGUARD_CONFIG)
    sh("systemctl", "daemon-reload")


def only(guard: str) -> None:
    """Stops every guard but `guard`, which is (re)started and ready."""
    for name, unit in SERVICES.items():
        if name != guard:
            sh("systemctl", "stop", unit)
    if guard in SERVICES:
        sh("systemctl", "restart", SERVICES[guard], check=True)


def make_slice(name: str) -> Path:
    Path(f"/run/systemd/system/{name}.slice").write_text(
        f"[Slice]\nMemoryMax={LIMIT}\nManagedOOMMemoryPressure=kill\n"
        "ManagedOOMMemoryPressureLimit=40%\n")
    sh("systemctl", "daemon-reload")
    sh("systemd-run", "--quiet", f"--unit={name}-idle", f"--slice={name}.slice",
       "-p", "StandardOutput=null", "sleep", "100000", check=True)
    path = CGROOT / f"{name}.slice"
    wait_for(path.exists, 10)
    return path


def armed(guard: str, cgroup: Path, since: str) -> bool:
    if guard != "oomguard":
        return True
    return bool(sh("journalctl", "-q", "-u", "oomguard", "--since", since, "-o", "cat",
                   "OOMGUARD_EVENT=guard.armed", f"OOMGUARD_CGROUP={cgroup}"))


def main_pid(unit: str) -> int:
    def read() -> int:
        text = sh("systemctl", "show", "-p", "MainPID", "--value", f"{unit}.service")
        return int(text or 0)
    return wait_for(read, 10, 0.02) or 0


class Sampler(threading.Thread):
    """Polls the slice's usage and the jobs' states: when usage first reached the threshold,
    and when a job was first stopped, frozen or gone."""

    def __init__(self, cgroup: Path, pids: dict[int, Path]) -> None:
        super().__init__(daemon=True)
        self.cgroup, self.pids = cgroup, pids
        self.cross: float | None = None
        self.action: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        current = self.cgroup / "memory.current"
        while not self.stop.is_set() and self.action is None:
            now = time.monotonic()
            if self.cross is None:
                try:
                    if int(current.read_text()) >= LIMIT * THRESHOLD:
                        self.cross = now
                except (OSError, ValueError):
                    pass
            for pid, cgroup in self.pids.items():
                if self._acted_on(pid, cgroup):
                    self.action = now
                    break
            time.sleep(POLL)

    @staticmethod
    def _acted_on(pid: int, cgroup: Path) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True  # gone
        if state in ("T", "t", "Z", "X"):
            return True
        try:
            return "frozen 1" in (cgroup / "cgroup.events").read_text()
        except OSError:
            return True


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def traced(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(line.split()[1:] != ["0"] for line in status.splitlines()
               if line.startswith("TracerPid:"))


def listed() -> dict[int, str]:
    """The checkpoints in the store, by the PID they were taken of."""
    return {int(str(c["pid"])): str(c["id"]) for c in checkpoints()
            if c.get("state") == "checkpointed"}


def checkpoints() -> list[dict[str, object]]:
    text = sh("oomguard", "list", "--json")
    try:
        return list(json.loads(text)) if text else []
    except ValueError:
        return []


def play(guard: str, key: str, number: int, work: Path, settle: float) -> Run:
    run = Run(guard, key)
    name = f"sbs{number}"
    since = sh("date", "+%Y-%m-%d %H:%M:%S")
    time.sleep(1)  # journal --since has one-second steps
    cgroup = make_slice(name)
    if not wait_for(lambda: armed(guard, cgroup, since), 30, 0.2):
        raise RuntimeError(f"oomguard did not arm {cgroup}")
    jobs: dict[int, tuple[str, Path]] = {}
    for index, template in enumerate(HOGS[key].jobs):
        unit, log = f"{name}-job{index}", work / f"{name}-job{index}.log"
        argv = [part.replace("{log}", str(log)) for part in template]
        sh("systemd-run", "--quiet", f"--unit={unit}", f"--slice={name}.slice",
           "-p", "StandardOutput=null", "-p", "StandardError=null", *argv, check=True)
        pid = main_pid(unit)
        jobs[pid] = (unit, log)
    sampler = Sampler(cgroup, {pid: cgroup / f"{unit}.service" for pid, (unit, _) in jobs.items()})
    sampler.start()
    # Until the sampler has seen the first action (it stops then: a job that ended before
    # this thread looked is the sampler's to time), and then every job has ended or `settle`
    # seconds have passed.
    def over() -> bool:
        if sampler.action is None:
            return False
        return not any(alive(pid) for pid in jobs) or time.monotonic() - sampler.action > settle
    wait_for(over, 240, 0.1)
    sampler.stop.set()
    sampler.join()
    run.cross_s, run.action_s = sampler.cross, sampler.action
    if guard == "oomguard":  # a dump under way (CRIU has seized the job) is waited out
        wait_for(lambda: not any(alive(pid) and traced(pid) for pid in jobs), 120, 0.2)
    saved = listed()
    if guard == "oomguard":
        # A job CRIU ended (SIGKILL once dumped: Result=signal) whose checkpoint is not listed
        # yet is still being committed (a cold dump under emulation can outlast `settle`).
        dumped = [pid for pid, (unit, _) in jobs.items() if pid not in saved and not alive(pid)
                  and sh("systemctl", "show", "-p", "Result", "--value",
                         f"{unit}.service") == "signal"]
        if dumped:
            wait_for(lambda: all(pid in listed() for pid in dumped), 120, 0.5)
            saved = listed()
    oomd = journal_count("systemd-oomd", f"{name}.slice", since)  # its kills in this slice
    for pid, (unit, log) in jobs.items():
        result = sh("systemctl", "show", "-p", "Result", "--value", f"{unit}.service")
        text = log.read_text() if log.exists() else ""
        if pid in saved:
            run.outcome.append("checkpointed")
            run.restored.append(restore(saved[pid], log, work))
        elif "done" in text:
            run.outcome.append("finished")
        elif alive(pid):
            run.outcome.append("running")
        elif oomd:
            run.outcome.append("killed (systemd-oomd)")
        elif journal_count("earlyoom", f"to process {pid} ", since):  # "sending SIGTERM to process N"
            run.outcome.append("killed (earlyoom)")
        elif result == "oom-kill":
            run.outcome.append("killed (kernel)")
        else:
            run.outcome.append(f"ended ({result})")
    if guard == "oomguard" and any(o != "checkpointed" for o in run.outcome):
        run.evidence = journal_lines("oomguard", since)[-40:] + \
            journal_lines("systemd-oomd", since)[-10:]
    for unit, _ in jobs.values():
        sh("systemctl", "stop", f"{unit}.service")
        sh("systemctl", "reset-failed", f"{unit}.service")
    sh("systemctl", "stop", f"{name}-idle.service", f"{name}.slice")
    for checkpoint_id in saved.values():
        sh("oomguard", "forget", checkpoint_id)
    return run


def restore(checkpoint_id: str, log: Path, work: Path) -> str:
    """Brings the checkpoint back into a roomy cgroup of its own; "ok" once the job has
    finished its count with its memory intact ("done N ok" / "done N pages")."""
    room = CGROOT / "sbs-restore"
    room.mkdir(exist_ok=True)
    (room / "memory.max").write_text(str(1 << 30))
    done = subprocess.run(["oomguard", "restore", checkpoint_id, "--cgroup", str(room)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        return f"restore failed: {done.stderr.strip()[-200:]}"
    pid = int(done.stdout.split()[0])
    finished = wait_for(lambda: [line for line in (log.read_text().splitlines()
                                                   if log.exists() else [])
                                 if line.startswith(("done", "corrupt"))], 240, 0.2)
    if alive(pid):
        os.kill(pid, 9)
    if not finished:
        return "restored, did not finish"
    return "ok" if finished[-1].endswith(("ok", "pages")) else f"restored: {finished[-1]}"


def as_json(run: Run) -> dict[str, object]:
    return {"guard": run.guard, "hog": run.hog, "outcome": run.outcome,
            "to_action_s": run.to_action, "restored": run.restored}


def cell(run: Run) -> str:
    what = ", ".join(run.outcome) or "?"
    if run.to_action is not None:
        what += f"; {run.to_action:.2f} s"
    elif run.cross_s is None:
        what += "; threshold not seen"
    if run.restored:
        what += "; restore: " + ", ".join(run.restored)
    return what


def report(runs: list[Run], guards: list[str], hogs: list[str]) -> str:
    by = {(r.guard, r.hog): r for r in runs}
    lines = ["| hog | " + " | ".join(guards) + " |", "|---" * (len(guards) + 1) + "|"]
    for key in hogs:
        lines.append(f"| {HOGS[key].name} | "
                     + " | ".join(cell(by[(g, key)]) for g in guards) + " |")
    lines += ["", "| guard | jobs saved | jobs killed | median threshold-to-action (s) | "
              "ratio to the kernel alone |", "|---|---|---|---|---|"]
    base = _median([by[("kernel", k)].to_action for k in hogs if ("kernel", k) in by])
    for guard in guards:
        mine = [by[(guard, k)] for k in hogs]
        outcomes = [o for r in mine for o in r.outcome]
        saved = sum(1 for o in outcomes if o in ("checkpointed", "finished", "running"))
        killed = sum(1 for o in outcomes if o.startswith("killed"))
        median = _median([r.to_action for r in mine])
        ratio = f"{median / base:.2f}" if median is not None and base else "-"
        lines.append(f"| {guard} | {saved} of {len(outcomes)} | {killed} | "
                     f"{'-' if median is None else f'{median:.2f}'} | {ratio} |")
    return "\n".join(lines) + "\n"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/sidebyside.py")
    parser.add_argument("--out", help="write the markdown here too")
    parser.add_argument("--json", help="the runs as JSON lines")
    parser.add_argument("--guards", default=",".join(GUARDS))
    parser.add_argument("--hogs", default=",".join(HOGS))
    parser.add_argument("--settle", type=float, default=20.0,
                        help="seconds a job is watched after the first action")
    args = parser.parse_args()
    guards, hogs = args.guards.split(","), args.hogs.split(",")
    unknown = [g for g in guards if g not in GUARDS] + [h for h in hogs if h not in HOGS]
    if unknown:
        print(f"sidebyside: unknown guard or hog: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("sidebyside: run as root, inside the host lane", file=sys.stderr)
        return 2
    work = Path("/tmp/sidebyside")
    work.mkdir(exist_ok=True)
    set_up_guards()
    runs: list[Run] = []
    number = 0
    for guard in guards:
        only(guard)
        for key in hogs:
            number += 1
            runs.append(play(guard, key, number, work, args.settle))
            print(f"[sidebyside] {guard} / {key}: {cell(runs[-1])}", flush=True)
            print(f"run_{guard}_{key}=" + json.dumps(as_json(runs[-1])), flush=True)
            for line in runs[-1].evidence:
                print(f"[sidebyside] {guard} / {key} journal: {line}", flush=True)
    for unit in SERVICES.values():
        sh("systemctl", "stop", unit)
    text = report(runs, guards, hogs)
    print(f"=== sidebyside table ===\n{text}=== end ===", flush=True)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(as_json(r)) + "\n" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
