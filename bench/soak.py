"""The soak drill (`scripts/soak MINUTES`): 20 guarded cgroups, hogs of random sizes at random
rates (some outgrow their limit, some do not), random restores, and the daemon SIGKILLed and
restarted at random. At the end every job has finished, is running, or is restorable from a
verified checkpoint; nothing is left stopped; no limit has changed; no OOM kill happened.

Exit status 0 when every invariant holds, 1 (with what broke) otherwise."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import machine
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from tests.helpers import (
    HOG,
    CgroupFactory,
    DaemonProcess,
    MiB,
    kill_pid,
    own_memory_cgroup,
    run_oomguard,
    start_in_cgroup,
)

GROUPS = 20
MAX_RUNNING = 5  # hogs alive at once (2 cores)
MIN_FREE_DISK = 10 << 30  # no new job while the disk holding the store has less free


@dataclass
class Job:
    name: str
    log: Path
    cgroup: str
    target_mib: int
    rate: int
    count: int
    pid: int
    proc: subprocess.Popen[bytes] | None = None
    restored_pid: int | None = None
    checkpoint: str | None = None

    def done_ok(self) -> bool:
        try:
            return f"done {self.count} ok" in self.log.read_text()
        except OSError:
            return False


@dataclass
class Tally:
    started: int = 0
    over_limit: int = 0
    checkpoints: int = 0
    restores: int = 0
    restore_refusals: int = 0
    daemon_kills: int = 0
    events: dict[str, int] = field(default_factory=dict)


def alive(pid: int | None, reader: ProcReader) -> bool:
    if not pid:
        return False
    try:
        return reader.state(pid) not in ("Z", "X")
    except Exception:
        return False


def run(minutes: float, workdir: Path, seed: int) -> tuple[bool, dict[str, Any]]:
    rng = random.Random(seed)
    parent = own_memory_cgroup()
    if parent is None:
        raise SystemExit("soak: no memory cgroup controller here")
    factory = CgroupFactory(parent=parent, tag=f"soak{os.getpid()}")
    reader = ProcReader()
    tally = Tally()
    jobs: list[Job] = []
    store = workdir / "store"
    try:
        top = factory.make("top", None)
        groups = []
        for index in range(GROUPS):
            cg = top.child(f"c{index:02d}")
            cg.create()
            cg.set_limit(rng.choice([128, 160, 192, 224, 256]) * MiB)
            factory.created.append(cg)
            groups.append(cg)
        big = factory.make("big", 2048 * MiB)  # where restored jobs finish (guarded too)
        limits = {str(cg.path): cg.limit() for cg in [*groups, big]}
        config = workdir / "soak.toml"
        config.write_text(f'[daemon]\nrescan_interval = "500ms"\n\n[[guard]]\n'
                          f'cgroups = ["{top.path}/c*", "{big.path}"]\n'
                          'oom_kill_disable = true\n')
        daemon_log = workdir / "daemon.log"
        daemon = DaemonProcess(store, daemon_log, "--config", str(config))
        # Jobs start once every guard is armed (the invariant is about armed guards).
        daemon.wait_event("guard.armed", count=GROUPS + 1, timeout=60)
        deadline = time.monotonic() + minutes * 60
        next_kill = time.monotonic() + rng.uniform(20, 60)
        while time.monotonic() < deadline:
            running = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
            busy = {j.cgroup for j in running}
            free = [g for g in groups if str(g.path) not in busy]
            room = shutil.disk_usage(workdir).free >= MIN_FREE_DISK
            if len(running) < MAX_RUNNING and free and room:
                # One job per cgroup at a time, as a batch scheduler gives each job its own.
                cg = rng.choice(free)
                limit_mib = (cg.limit() or 0) // MiB
                target = rng.randint(16, int(limit_mib * 1.6))
                rate = rng.choice([50, 100, 300, 1000])
                job = Job(name=f"j{len(jobs):04d}", log=workdir / f"j{len(jobs):04d}.log",
                          cgroup=str(cg.path), target_mib=target, rate=rate,
                          count=rng.randint(100, 400), pid=0)
                argv = [sys.executable, str(HOG), "--log", str(job.log), "--target", str(target),
                        "--rate", str(rate), "--count", str(job.count), "--tick", "0.02"]
                job.proc = start_in_cgroup(cg, argv, cwd=workdir,
                                           log=workdir / f"{job.name}.err")
                job.pid = job.proc.pid
                jobs.append(job)
                tally.started += 1
                tally.over_limit += target > limit_mib * 0.85
            # Restores keep up with checkpoints (else the images fill the disk): the two
            # oldest waiting ones each turn, at random moments after they were taken.
            if rng.random() < 0.5:
                _restore_one(jobs, store, big.path, tally, rng, oldest=2)
            if time.monotonic() >= next_kill:
                daemon.handle.send_signal(signal.SIGKILL)
                daemon.handle.wait()
                tally.daemon_kills += 1
                daemon = DaemonProcess(store, daemon_log, "--config", str(config),
                                       socket=daemon.socket)
                next_kill = time.monotonic() + rng.uniform(20, 60)
            time.sleep(rng.uniform(0.2, 1.0))
        # Wind down: no new jobs; let the running ones finish, restore what is left once.
        end = time.monotonic() + 90
        while time.monotonic() < end and any(
                j.proc is not None and j.proc.poll() is None for j in jobs):
            time.sleep(0.5)
        for _ in range(3):
            _restore_one(jobs, store, big.path, tally, rng, every=True)
        end = time.monotonic() + 90
        while time.monotonic() < end and any(alive(j.restored_pid, reader) and not j.done_ok()
                                             for j in jobs):
            time.sleep(0.5)
        for event in daemon.events():
            name = str(event.get("event"))
            tally.events[name] = tally.events.get(name, 0) + 1
        problems = _check(jobs, store, groups, big, limits, reader, daemon.handle.poll())
        daemon.stop()
    finally:
        for job in jobs:
            kill_pid(job.pid)
            if job.restored_pid:
                kill_pid(job.restored_pid)
        factory.cleanup()
    tally.checkpoints = tally.events.get("checkpoint.done", 0)
    report = {"minutes": minutes, "seed": seed, "tally": tally.__dict__,
              "problems": problems, "jobs": len(jobs),
              "finished": sum(j.done_ok() for j in jobs)}
    return not problems, report


def _restore_one(jobs: list[Job], store: Path, big: Path, tally: Tally, rng: random.Random,
                 every: bool = False, oldest: int = 1) -> None:
    metas = [m for m in Store(store).list() if m.state == "checkpointed"]
    if not metas:
        return
    for meta in (metas if every else metas[:oldest]):
        result = run_oomguard(store, "restore", meta.id, "--cgroup", str(big), timeout=180)
        job = next((j for j in jobs if j.pid == meta.pid), None)
        if result.returncode == 0 and result.stdout.strip().isdigit():
            tally.restores += 1
            run_oomguard(store, "forget", meta.id)  # restored: its images only take disk
            if job is not None:
                job.restored_pid = int(result.stdout.strip())
                job.checkpoint = meta.id
        else:
            tally.restore_refusals += 1


def _check(jobs: list[Job], store: Path, groups: list[Any], big: Any,
           limits: dict[str, int | None], reader: ProcReader,
           daemon_exit: int | None) -> list[str]:
    problems = []
    if daemon_exit is not None:
        problems.append(f"the daemon died on its own (exit {daemon_exit})")
    stored = {m.pid: m for m in Store(store).list()}
    for job in jobs:
        if job.done_ok() or alive(job.restored_pid, reader) or (
                job.proc is not None and job.proc.poll() is None):
            continue
        meta = stored.get(job.pid)
        if meta is not None and meta.state == "checkpointed":
            try:
                Store(store).verify(meta.id)
                continue
            except Exception as exc:
                problems.append(f"{job.name}: checkpoint {meta.id} does not verify: {exc}")
                continue
        code = job.proc.returncode if job.proc is not None else None
        problems.append(f"{job.name} (pid {job.pid}, {job.target_mib} MiB at {job.rate} MB/s "
                        f"in {Path(job.cgroup).name}) is lost: exit {code}, no checkpoint")
    for cg in [*groups, big]:
        if cg.limit() != limits[str(cg.path)]:
            problems.append(f"{cg.path.name}: limit {cg.limit()} != {limits[str(cg.path)]}")
        snap = cg.snapshot()
        if snap.oom_kills:
            problems.append(f"{cg.path.name}: {snap.oom_kills} OOM kill(s)")
        for pid in cg.procs():
            if reader.state(pid) == "T":
                problems.append(f"{cg.path.name}: process {pid} left stopped")
    return problems


def markdown(report: dict[str, Any]) -> str:
    t = report["tally"]
    rows = [("minutes", report["minutes"]), ("seed", report["seed"]),
            ("jobs started", t["started"]), ("jobs meant to outgrow the threshold",
                                             t["over_limit"]),
            ("jobs finished (counter complete, memory verified)", report["finished"]),
            ("checkpoints", t["checkpoints"]), ("restores", t["restores"]),
            ("restores refused (PID in use, no room...)", t["restore_refusals"]),
            ("daemon SIGKILLs and restarts", t["daemon_kills"]),
            ("invariants broken", len(report["problems"]))]
    lines = ["| what | count |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
    if report.get("machine"):
        lines += ["", "Measured on:", "", "| what | value |", "|---|---|",
                  *[f"| {k} | {v} |" for k, v in report["machine"].items()]]
    if report["problems"]:
        lines += ["", "Broken:", *[f"- {p}" for p in report["problems"]]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak")
    parser.add_argument("minutes", type=float)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (logs, store) instead of deleting it")
    args = parser.parse_args()
    workdir = args.workdir or Path(subprocess.check_output(
        ["mktemp", "-d", "/var/tmp/oomguard-soak.XXXXXX"], text=True).strip())
    try:
        ok, report = run(args.minutes, workdir, args.seed)
        report["machine"] = machine(workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    text = markdown(report)
    print(text)
    print(json.dumps(report, indent=1), file=sys.stderr)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
