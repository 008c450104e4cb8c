"""Victims CRIU cannot dump (issue 29): jobs holding a Unix connection to a server outside
their tree grow past a 256 MiB cgroup's limit, one at a time, under each guard in turn:

- the kernel alone (its OOM killer, at the limit);
- Debian's earlyoom (`-m 10`, its binary unpacked by scripts/bench): it watches the
  machine's free memory, not a cgroup's limit;
- oomguard with `actions = ["checkpoint", "kill"]`: CRIU refuses the connection, so the kill
  step ends the job (a logged, explained kill);
- oomguard with `actions = ["checkpoint", "pageout"]`: the job is paged out and kept stopped;
  the limit is then raised and the job is continued by the auto-restore rule.

A job is `saved` when it ran to its end with every byte of its memory as it wrote it (it checks
its chunks and writes "done N ok"), `killed` (by whom: the kernel's oom_kill count, or
oomguard's victim.killed event) or `other`.

Alongside, the RAM each gives back per second: the page-out step (from the checkpoint's
refusal to victim.paged_out: a swap file made when the machine has none, process_madvise, the
swap cache reclaimed) against a checkpoint of a dumpable job of the same size, measured in the
same run (from victim.frozen to checkpoint.done), as the baseline; and the time from a
paged-out job's resume (`pageout.resumed`, once the limit is raised) to its next step written:
running again, its memory paged back in as it touches it.

Needs root, this machine's cgroup v1 and CRIU; while a page-out's swap file is on, the kernel
may swap other processes too, so each is removed as soon as its job is continued."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import Daemon, EventLog, event_time, guard_config, start_hog, summary
from oomguard.act.swapfiles import SwapFiles
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.store.names import SWAP_DIR
from tests.helpers import CgroupFactory, MiB, kill_pid, outside_server, short_socket_path

LIMIT = 256 * MiB
TARGET_MIB = 320  # over the limit: with no room made, the kernel kills every one
STEPS = 200  # a 4 MiB step every 20 ms to TARGET_MIB, then on to STEPS

CHUNKS = Path(__file__).resolve().parents[1] / "tests" / "workloads" / "chunks.py"


def _start_job(cgroup: V1MemoryCgroup, peer: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(CHUNKS), "--log", str(log), "--target", str(TARGET_MIB),
            "--count", str(STEPS), "--link", str(peer)]
    return subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                             str(cgroup.path / "cgroup.procs"), *argv],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _ended(log: Path) -> str:
    text = log.read_text() if log.exists() else ""
    return "saved" if f"done {STEPS} ok" in text else "corrupt" if "CORRUPT" in text else ""


def _steps(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if not line.startswith("done")) \
        if log.exists() else 0


def _next_step(log: Path, before: int, timeout: float) -> float:
    """When the job wrote its next step after `before` (its first once continued): the wall
    clock, read every millisecond."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _steps(log) > before or "done" in (log.read_text() if log.exists() else ""):
            return time.time()
        time.sleep(0.001)
    raise TimeoutError(f"{log.name}: no step within {timeout} s of its resume")


def one_job(cgroup: V1MemoryCgroup, work: Path, name: str, peer: Path,
            events: EventLog | None, resume: bool) -> tuple[str, dict[str, Any]]:
    """What became of one job, and for a page-out its figures."""
    cgroup.set_limit(LIMIT)
    before = cgroup.snapshot().oom_kills
    mark = len(events.seen) if events is not None else 0
    log = work / f"{name}.log"
    log.unlink(missing_ok=True)
    job = _start_job(cgroup, peer, log)
    figures: dict[str, Any] = {}
    try:
        if resume and events is not None:
            refused = events.wait("checkpoint.failed", 60, {"pid": job.pid}, after=mark)
            paged = events.wait("victim.paged_out", 60, {"pid": job.pid}, after=mark)
            seconds = event_time(paged) - event_time(refused)
            figures = {"paged_mib": paged["paged_bytes"] / MiB, "seconds": seconds,
                       "mib_per_s": paged["paged_bytes"] / MiB / max(seconds, 1e-6),
                       "swap_file_made": bool(paged.get("swap_files"))}
            steps_before = _steps(log)  # stopped: nothing written until it is continued
            cgroup.set_limit(2 * LIMIT)  # room again: continued by the auto-restore rule
            resumed = event_time(events.wait("pageout.resumed", 60, after=mark))
            running = _next_step(log, steps_before, 60)
            figures["to_running_s"] = running - resumed
        try:
            job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            return "other", figures
    finally:
        kill_pid(job.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=10)
    if _ended(log):
        return _ended(log), figures
    if events is not None:
        try:  # said once the kill step has seen the tree end, a moment after the job's end
            events.wait("victim.killed", 15, {"pid": job.pid}, after=mark)
            return "killed by oomguard", figures
        except TimeoutError:
            pass
    if cgroup.snapshot().oom_kills > before:
        return "killed by the kernel", figures
    return "other", figures


def _guard(factory: CgroupFactory, work: Path, label: str, jobs: int, peer: Path,
           actions: list[str] | None, earlyoom: Path | None = None) -> dict[str, Any]:
    cgroup = factory.make(f"undumpable-{label}", LIMIT)
    assert isinstance(cgroup, V1MemoryCgroup)
    daemon = peer_guard = None
    events = None
    store = work / f"store-undumpable-{label}"
    if actions is not None:
        config = guard_config(work / f"undumpable-{label}.toml", store, [str(cgroup.path)],
                              actions=actions, restore_quiet="1s")  # type: ignore[arg-type]
        daemon = Daemon(store, config, work / f"undumpable-{label}.log")
        events = daemon.start()
        events.wait("guard.ready", 60)
    elif earlyoom is not None:
        peer_guard = subprocess.Popen([str(earlyoom), "-m", "10"],
                                      stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                      stdout=open(work / "earlyoom.log", "wb"))  # noqa: SIM115
        time.sleep(1)
    outcomes: list[str] = []
    pageouts: list[dict[str, Any]] = []
    try:
        for index in range(jobs):
            outcome, figures = one_job(cgroup, work, f"undumpable-{label}-{index}", peer,
                                       events, resume=actions is not None
                                       and "pageout" in actions)
            outcomes.append(outcome)
            if figures:
                pageouts.append(figures)
    finally:
        if daemon is not None:
            daemon.stop()
        if peer_guard is not None:
            peer_guard.terminate()
            peer_guard.wait(10)
        for area in SwapFiles(store / SWAP_DIR).ours():
            with contextlib.suppress(Exception):
                SwapFiles(store / SWAP_DIR).remove(Path(area.path))
        shutil.rmtree(store, ignore_errors=True)
    result: dict[str, Any] = {"jobs": jobs, "outcomes": {o: outcomes.count(o)
                                                        for o in sorted(set(outcomes))}}
    if pageouts:
        result["pageout"] = {"mib_per_s": summary([p["mib_per_s"] for p in pageouts]),
                             "seconds": summary([p["seconds"] for p in pageouts]),
                             "paged_mib": summary([p["paged_mib"] for p in pageouts]),
                             "to_running_s": summary([p["to_running_s"] for p in pageouts])}
    return result


def _checkpoint_baseline(factory: CgroupFactory, work: Path, runs: int) -> dict[str, Any]:
    """A dumpable job of the same size (tests/workloads/hog.py) checkpointed by the default
    chain: its RAM given back per second, frozen to committed."""
    cgroup = factory.make("undumpable-baseline", LIMIT)
    store = work / "store-undumpable-baseline"
    config = guard_config(work / "undumpable-baseline.toml", store, [str(cgroup.path)])
    daemon = Daemon(store, config, work / "undumpable-baseline.log")
    events = daemon.start()
    events.wait("guard.ready", 60)
    rates, seconds = [], []
    try:
        for index in range(runs):
            mark = len(events.seen)
            hog = start_hog(cgroup.path, work, f"undumpable-baseline-{index}",
                            target_mib=TARGET_MIB, rate=200.0, chunk=4)
            try:
                frozen = events.wait("victim.frozen", 60, {"pid": hog.proc.pid}, after=mark)
                done = events.wait("checkpoint.done", 120, {"pid": hog.proc.pid}, after=mark)
            finally:
                hog.kill()
            took = event_time(done) - event_time(frozen)
            seconds.append(took)
            rates.append(int(done["rss"]) / MiB / max(took, 1e-6))
            shutil.rmtree(done["path"], ignore_errors=True)
    finally:
        daemon.stop()
        shutil.rmtree(store, ignore_errors=True)
    return {"mib_per_s": summary(rates), "seconds": summary(seconds)}


def undumpable(factory: CgroupFactory, work: Path, jobs: int,
               earlyoom: Path | None) -> dict[str, Any]:
    peer = short_socket_path().with_name("undumpable-peer.sock")
    server, accepted = outside_server(peer)
    try:
        results: dict[str, Any] = {
            "limit_mib": LIMIT // MiB, "target_mib": TARGET_MIB,
            "kernel": _guard(factory, work, "kernel", jobs, peer, None),
        }
        if earlyoom is not None:
            results["earlyoom"] = _guard(factory, work, "earlyoom", jobs, peer, None, earlyoom)
        results["oomguard_checkpoint_kill"] = _guard(factory, work, "kill", jobs, peer,
                                                     ["checkpoint", "kill"])
        results["oomguard_checkpoint_pageout"] = _guard(factory, work, "pageout", jobs, peer,
                                                        ["checkpoint", "pageout"])
        results["checkpoint_baseline"] = _checkpoint_baseline(factory, work, jobs)
        page = results["oomguard_checkpoint_pageout"].get("pageout")
        if page:
            results["pageout_vs_checkpoint"] = round(
                page["mib_per_s"]["median"]
                / max(results["checkpoint_baseline"]["mib_per_s"]["median"], 1e-6), 2)
        return results
    finally:
        server.close()
        for conn in accepted:
            conn.close()
        shutil.rmtree(peer.parent, ignore_errors=True)
