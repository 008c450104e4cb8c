"""The soak drill (`scripts/soak MINUTES`): 20 guarded cgroups, hogs of random sizes at random
rates (some outgrow their limit, some do not), up to two at a time in each cgroup, half of them
also writing a file through write(2) (page cache, which fails with ENOMEM rather than waiting
at the limit), random restores, and the daemon SIGKILLed and restarted at random. At the end
every job has finished, is running, or is restorable from a verified checkpoint (none ended
with ENOMEM or was OOM-killed: each loss is named with its path, bench/soakcheck.py); nothing
is left stopped; no limit has changed; no OOM kill happened.

`--small-store MIB` puts the store on a real small file system (ext4 on a loop device) with a
budget (bench/soakstore.py): restored checkpoints are left for the budget to prune, and the
store must never go over store_max_size nor its file system below store_keep_free.
`--auto-restore` has the daemon restore checkpoints itself while the drill's own restores race
it for the same ones (a restore lost to the race is counted, never a job run twice).

Exit status 0 when every invariant holds, 1 (with what broke) otherwise."""

from __future__ import annotations

import argparse
import contextlib
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
from bench.soakcheck import (
    ending,
    evidence,
    handlings,
    last_sign_of_life,
    oom_evidence,
    restart_gaps,
)
from bench.soakstore import BudgetWatch, budget_config, loop_store
from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.mounts import open_cgroup, read_layout
from oomguard.cgroup.v2 import V2MemoryCgroup
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
MAX_RUNNING = 6  # hogs alive at once (2 cores)
PER_CGROUP = 2  # hogs alive at once in one cgroup
RESTART_EVERY = (20.0, 60.0)  # seconds between daemon SIGKILLs, at random in this range
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
    writes: bool = False  # also appends to a file through write(2)
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
    restore_races: int = 0  # a manual restore that found the daemon restoring it, or done
    auto_restores: int = 0  # the daemon's own (restore.done, auto)
    asked_checkpoints: int = 0  # --auto-restore: small jobs checkpointed on request
    daemon_kills: int = 0
    writers: int = 0
    events: dict[str, int] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)  # wall-clock times of the SIGKILLs
    refusals: list[str] = field(default_factory=list)  # why restores were refused
    losses: dict[str, int] = field(default_factory=dict)  # cause -> jobs
    restart_gaps: list[float] = field(default_factory=list)  # SIGKILL -> next guard.ready, s
    evidence: dict[str, list[str]] = field(default_factory=dict)  # lost job -> daemon events


def open_path(path: Path) -> MemoryCgroup:
    """--parent: a memory cgroup by its directory (v1 or v2), such as a scope systemd
    delegated to the drill (scripts/soak-host)."""
    layout = read_layout()
    mount = layout.memory_mount
    if mount is None:
        raise SystemExit("soak: no memory cgroup controller here")
    try:
        rel = path.resolve().relative_to(mount)
    except ValueError:
        raise SystemExit(f"soak: --parent {path} is not under {mount}") from None
    return open_cgroup("/" + str(rel), layout)


def alive(pid: int | None, reader: ProcReader) -> bool:
    if not pid:
        return False
    try:
        return reader.state(pid) not in ("Z", "X")
    except Exception:
        return False


def run(minutes: float, workdir: Path, seed: int, per_cgroup: int = PER_CGROUP,
        restart_every: tuple[float, float] = RESTART_EVERY, small_store: int = 0,
        auto_restore: bool = False, parent: Path | None = None,
        min_free_disk: int = MIN_FREE_DISK) -> tuple[bool, dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(loop_store(workdir, small_store)) / "store" \
            if small_store else workdir / "store"
        watch = BudgetWatch(store.parent, store) if small_store else None
        try:
            return _run(minutes, workdir, seed, per_cgroup, restart_every, store, watch,
                        auto_restore, parent, min_free_disk)
        finally:
            if watch is not None:
                watch.stop()
    raise AssertionError("unreachable")


def _run(minutes: float, workdir: Path, seed: int, per_cgroup: int,
         restart_every: tuple[float, float], store: Path, watch: BudgetWatch | None,
         auto_restore: bool, parent_path: Path | None,
         min_free_disk: int) -> tuple[bool, dict[str, Any]]:
    rng = random.Random(seed)
    parent = own_memory_cgroup() if parent_path is None else open_path(parent_path)
    if parent is None:
        raise SystemExit("soak: no memory cgroup controller here")
    factory = CgroupFactory(parent=parent, tag=f"soak{os.getpid()}")
    reader = ProcReader()
    tally = Tally()
    jobs: list[Job] = []
    keep = watch is not None  # restored checkpoints are left for the budget to prune
    daemon: DaemonProcess | None = None  # stopped first on any way out (SIGINT included)
    try:
        top = factory.make("top", None)
        if isinstance(top, V2MemoryCgroup):  # cgroup v2: the groups below need the controller
            (top.path / "cgroup.subtree_control").write_text("+memory")
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
        budget = budget_config() if watch is not None else ""
        restoring = f'auto_restore = true\nrestore_quiet = "{RACE_AFTER:g}s"\n' \
            'restore_retry = "5s"\n' if auto_restore else ""
        after = RACE_AFTER if auto_restore else 0.0  # the drill's restores race the daemon's
        config.write_text(f'[daemon]\nrescan_interval = "500ms"\n{budget}\n[[guard]]\n'
                          f'cgroups = ["{top.path}/c*", "{big.path}"]\n'
                          f'oom_kill_disable = true\n{restoring}')
        daemon_log = workdir / "daemon.log"
        daemon = DaemonProcess(store, daemon_log, "--config", str(config))
        # Jobs start once every guard is armed (the invariant is about armed guards).
        daemon.wait_event("guard.armed", count=GROUPS + 1, timeout=60)
        deadline = time.monotonic() + minutes * 60
        next_kill = time.monotonic() + rng.uniform(*restart_every)
        while time.monotonic() < deadline:
            running = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
            busy: dict[str, int] = {}
            for j in running:
                busy[j.cgroup] = busy.get(j.cgroup, 0) + 1
            free = [g for g in groups if busy.get(str(g.path), 0) < per_cgroup]
            room = shutil.disk_usage(workdir).free >= min_free_disk
            if len(running) < MAX_RUNNING and free and room:
                # Up to `per_cgroup` jobs in a cgroup at a time, as people share one.
                cg = rng.choice(free)
                limit_mib = (cg.limit() or 0) // MiB
                # Together they outgrow the threshold about as often as one job alone did.
                share = 1.6 if per_cgroup == 1 else 1.0
                target = rng.randint(16, int(limit_mib * share))
                rate = rng.choice([50, 100, 300, 1000])
                job = Job(name=f"j{len(jobs):04d}", log=workdir / f"j{len(jobs):04d}.log",
                          cgroup=str(cg.path), target_mib=target, rate=rate,
                          count=rng.randint(100, 400), pid=0, writes=rng.random() < 0.5)
                argv = [sys.executable, str(HOG), "--log", str(job.log), "--target", str(target),
                        "--rate", str(rate), "--count", str(job.count), "--tick", "0.02"]
                if job.writes:  # page cache through write(2): ENOMEM at the limit, no wait
                    argv += ["--write", str(workdir / f"{job.name}.dat"), "--write-kib",
                             str(rng.choice([64, 256, 1024])), "--write-max", "32"]
                    tally.writers += 1
                job.proc = start_in_cgroup(cg, argv, cwd=workdir,
                                           log=workdir / f"{job.name}.err")
                job.pid = job.proc.pid
                jobs.append(job)
                tally.started += 1
                tally.over_limit += target > limit_mib * 0.85
            # Restores keep up with checkpoints (else the images fill the disk): the two
            # oldest waiting ones each turn, at random moments after they were taken.
            if rng.random() < 0.5:
                _restore_one(jobs, store, big.path, tally, rng, oldest=2, keep=keep,
                             after=after)
            if auto_restore and rng.random() < 0.3:
                _checkpoint_small(running, tally, rng, daemon.socket)
            if watch is not None:
                watch.turn()
            if time.monotonic() >= next_kill:
                tally.restarts.append(time.time())
                daemon.handle.send_signal(signal.SIGKILL)
                daemon.handle.wait()
                tally.daemon_kills += 1
                daemon = DaemonProcess(store, daemon_log, "--config", str(config),
                                       socket=daemon.socket)
                next_kill = time.monotonic() + rng.uniform(*restart_every)
            time.sleep(rng.uniform(0.2, 1.0))
        # Wind down: no new jobs; let the running ones finish, restore what is left once.
        end = time.monotonic() + 90
        while time.monotonic() < end and any(
                j.proc is not None and j.proc.poll() is None for j in jobs):
            time.sleep(0.5)
        for _ in range(3):
            _restore_one(jobs, store, big.path, tally, rng, every=True, keep=keep)
        end = time.monotonic() + 90
        while time.monotonic() < end and any(
                (alive(j.restored_pid, reader) or _restored_by_daemon(j)) and not j.done_ok()
                for j in jobs):
            time.sleep(0.5)
        events = daemon.events()
        for event in events:
            name = str(event.get("event"))
            tally.events[name] = tally.events.get(name, 0) + 1
            tally.auto_restores += name == "restore.done" and event.get("auto") is True
        problems = _check(jobs, store, groups, big, limits, reader, daemon.handle.poll(),
                          tally, events, workdir)
        if watch is not None:
            problems += watch.stop().problems()
        tally.restart_gaps = restart_gaps(tally.restarts, events)
    finally:
        if daemon is not None:
            daemon.stop()  # before the jobs and cgroups: it must not act on what goes away
        for job in jobs:
            kill_pid(job.pid)
            if job.restored_pid:
                kill_pid(job.restored_pid)
        factory.cleanup()
    tally.checkpoints = tally.events.get("checkpoint.done", 0)
    report = {"minutes": minutes, "seed": seed, "per_cgroup": per_cgroup, "tally": tally.__dict__,
              "problems": problems, "jobs": len(jobs),
              "finished": sum(j.done_ok() for j in jobs), "auto_restore": auto_restore,
              "budget": watch.figures.__dict__ if watch is not None else None}
    return not problems, report


RACE_LOST = ("being restored right now", "already restored", "no checkpoint")
RACE_AFTER = 1.0  # --auto-restore: restore_quiet, and the age the drill's restores wait for


def _checkpoint_small(running: list[Job], tally: Tally, rng: random.Random,
                      socket: Path) -> None:
    """--auto-restore: a job well under its cgroup's threshold checkpointed on request, so
    that its checkpoint fits back and the daemon's auto-restore and the drill's race for it
    (one taken at the threshold never fits back under it)."""
    small = [j for j in running if j.target_mib <= 48 and j.rate <= 100 and not j.writes]
    if not small:
        return
    job = rng.choice(small)
    asked = subprocess.run([sys.executable, "-m", "oomguard", "--socket", str(socket),
                            "checkpoint", str(job.pid)], capture_output=True, text=True,
                           timeout=180, stdin=subprocess.DEVNULL)
    tally.asked_checkpoints += asked.returncode == 0  # through the daemon: its budget


def _restore_one(jobs: list[Job], store: Path, big: Path, tally: Tally, rng: random.Random,
                 every: bool = False, oldest: int = 1, keep: bool = False,
                 after: float = 0.0) -> None:
    metas = [m for m in Store(store).list() if m.state == "checkpointed"
             and time.time() - m.created >= after]
    if not metas:
        return
    for meta in (metas if every else metas[:oldest]):
        try:
            result = run_oomguard(store, "restore", meta.id, "--cgroup", str(big), timeout=180)
        except subprocess.TimeoutExpired:  # counted, and the drill goes on to its checks
            tally.restore_refusals += 1
            tally.refusals.append(f"{meta.id}: restore still running after 180 s")
            continue
        job = next((j for j in jobs if j.pid == meta.pid), None)
        if result.returncode == 0 and result.stdout.strip().isdigit():
            tally.restores += 1
            if not keep:
                run_oomguard(store, "forget", meta.id)  # restored: its images only take disk
            if job is not None:
                job.restored_pid = int(result.stdout.strip())
                job.checkpoint = meta.id
        elif any(lost in result.stderr for lost in RACE_LOST):
            tally.restore_races += 1  # the daemon's auto-restore had it (or was at it)
        else:
            tally.restore_refusals += 1
            lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
            tally.refusals.append(f"{meta.id}: {lines[-1][-300:] if lines else result.returncode}")


def _check(jobs: list[Job], store: Path, groups: list[Any], big: Any,
           limits: dict[str, int | None], reader: ProcReader,
           daemon_exit: int | None, tally: Tally, events: list[dict[str, Any]],
           workdir: Path) -> list[str]:
    problems = []
    handled = handlings(events)
    if daemon_exit is not None:
        problems.append(f"the daemon died on its own (exit {daemon_exit})")
    stored = {m.pid: m for m in Store(store).list()}
    for job in jobs:
        if job.done_ok() or alive(job.restored_pid, reader) or (
                job.proc is not None and job.proc.poll() is None) or _restored_by_daemon(job):
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
        # Restored, then ended: its exit is the restored process's (the daemon watched it),
        # not the SIGKILL CRIU gave the original.
        exits = [e for e in events if e.get("event") == "restore.exited"
                 and e.get("pid") == job.pid and e.get("exit_status") is not None]
        restored_note = ""
        if exits:
            code, restored_note = int(exits[-1]["exit_status"]), "after its restore"
        err = workdir / f"{job.name}.err"
        why = ending(code, err.read_text(errors="replace") if err.exists() else "",
                     last_sign_of_life(job.log, err), job.cgroup, job.pid, tally.restarts,
                     handled, events)
        if restored_note:
            why.context.insert(0, restored_note)
        tally.losses[why.cause] = tally.losses.get(why.cause, 0) + 1
        writes = ", writing a file" if job.writes else ""
        problems.append(f"{job.name} (pid {job.pid}, {job.target_mib} MiB at {job.rate} MB/s"
                        f"{writes} in {Path(job.cgroup).name}) is lost: {why.words()}")
        tally.evidence[job.name] = evidence(events, job.cgroup, job.pid,
                                            last_sign_of_life(job.log, err))
    for cg in [*groups, big]:
        if cg.limit() != limits[str(cg.path)]:
            problems.append(f"{cg.path.name}: limit {cg.limit()} != {limits[str(cg.path)]}")
        snap = cg.snapshot()
        if snap.oom_kills:
            problems.append(f"{cg.path.name}: {snap.oom_kills} OOM kill(s)")
            tally.evidence[f"{cg.path.name}'s OOM kill"] = oom_evidence(events, str(cg.path))
        for pid in cg.procs():
            if reader.state(pid) == "T":
                problems.append(f"{cg.path.name}: process {pid} left stopped")
    return problems


def _restored_by_daemon(job: Job) -> bool:
    """Running again under its own PID (CRIU restores PIDs), restored by the daemon."""
    try:
        return str(job.log) in Path(f"/proc/{job.pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


def markdown(report: dict[str, Any]) -> str:
    t = report["tally"]
    rows = [("minutes", report["minutes"]), ("seed", report["seed"]),
            ("jobs started", t["started"]), ("jobs meant to outgrow the threshold",
                                             t["over_limit"]),
            ("jobs writing a file through write(2)", t["writers"]),
            ("jobs at a time in one cgroup (at most)", report["per_cgroup"]),
            ("jobs finished (counter complete, memory verified)", report["finished"]),
            ("checkpoints", t["checkpoints"]),
            ("of which asked for (small jobs, to race the daemon's auto-restore)",
             t["asked_checkpoints"]), ("restores", t["restores"]),
            ("restores refused (PID in use, no room...)", t["restore_refusals"]),
            ("daemon auto-restores (racing the drill's)",
             t["auto_restores"] if report.get("auto_restore") else "-"),
            ("drill restores that lost the race to the daemon's", t["restore_races"]),
            ("daemon SIGKILLs and restarts", t["daemon_kills"]),
            ("restart gap, SIGKILL to every guard armed (max s)",
             max(t["restart_gaps"], default="-")),
            ("jobs lost to ENOMEM", t["losses"].get("enomem", 0)),
            ("jobs OOM-killed", t["losses"].get("oom-killed", 0)),
            ("invariants broken", len(report["problems"]))]
    budget = report.get("budget")
    if budget:
        rows[-1:-1] = [
            ("store file system (MiB, ext4 on a loop device)", budget["total"] >> 20),
            ("store_max_size (MiB) / highest store use (MiB)",
             f"{budget['cap'] >> 20} / {budget['highest_used'] >> 20}"),
            ("store_keep_free (MiB) / lowest free (MiB)",
             f"{budget['keep_free'] >> 20} / {budget['lowest_free'] >> 20}"),
            ("checkpoints refused by the budget", t["events"].get("checkpoint.refused", 0)),
            ("restored checkpoints pruned", t["events"].get("store.pruned", 0))]
    lines = ["| what | count |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
    if report.get("machine"):
        lines += ["", "Measured on:", "", "| what | value |", "|---|---|",
                  *[f"| {k} | {v} |" for k, v in report["machine"].items()]]
    if report["problems"]:
        lines += ["", "Broken:", *[f"- {p}" for p in report["problems"]]]
    for name, trail in t.get("evidence", {}).items():
        lines += ["", f"The daemon's events around {name}'s end (its cgroup or its pid):"
                  if not name.endswith("OOM kill") else
                  f"The daemon's events around {name} (its cgroup):", "",
                  "```", *trail, "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak")
    parser.add_argument("minutes", type=float)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--per-cgroup", type=int, default=PER_CGROUP,
                        help="jobs at a time in one cgroup (default 2)")
    parser.add_argument("--restart-every", type=float, nargs=2, default=RESTART_EVERY,
                        metavar=("MIN", "MAX"), help="seconds between daemon SIGKILLs "
                        "(default 20 60)")
    parser.add_argument("--small-store", type=int, default=0, metavar="MIB",
                        help="the store on an ext4 file system of this size on a loop device, "
                        "with a budget (bench/soakstore.py); 0: beside the work directory")
    parser.add_argument("--auto-restore", action="store_true",
                        help="the daemon restores checkpoints itself, racing the drill's")
    parser.add_argument("--parent", type=Path, default=None,
                        help="create the drill's cgroups beneath this one (a directory under "
                        "the memory controller's mount; default: the drill's own cgroup)")
    parser.add_argument("--min-free-disk", type=int, default=MIN_FREE_DISK >> 20,
                        metavar="MIB", help="no new job while the work directory's disk has "
                        "less free (default 10240)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (logs, store) instead of deleting it")
    args = parser.parse_args()
    workdir = args.workdir or Path(subprocess.check_output(
        ["mktemp", "-d", "/var/tmp/oomguard-soak.XXXXXX"], text=True).strip())
    try:
        ok, report = run(args.minutes, workdir, args.seed, args.per_cgroup,
                         tuple(args.restart_every), args.small_store, args.auto_restore,
                         args.parent, args.min_free_disk << 20)
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
