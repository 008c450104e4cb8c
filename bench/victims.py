"""Victim choice on a crowded machine: 10,000 processes (`sleep`, in a cgroup of their own
beneath ours, a hundred to a parent; then all of one parent) beside the job, and the time the
daemon spends reading and ranking the candidate trees at the crossing (`choose_ms` in its
victim.frozen / victim.chosen events):

- a cgroup rule, real checkpoints: the candidates come from the guarded cgroup's cgroup.procs;
- a system rule, dry run (it must not touch anything on this machine but may choose any
  process): the candidates come from the ranking kept while memory got low.

Baseline, measured in the same run beside them: what choosing for a system rule cost before
the ranking, a walk of every process in /proc (ProcReader over all_pids, then the same
policy), timed in this process."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from bench.harness import Daemon, guard_config, start_hog, summary
from bench.latency import wait_for_ready
from oomguard.policy.victims import rank_victims, system_candidates
from oomguard.sense.procfs import ProcReader
from tests.helpers import CgroupFactory, MiB, wait_until

# $1 cgroup, $2 parents, $3 children each, $4 flag file: `parents` shells in sessions of their
# own, each with `children` sleeping processes (one parent of 10,000 children: 1 10000).
CROWD_SPAWNER = r"""
echo $$ > "$1/cgroup.procs"
p=0
while [ $p -lt "$2" ]; do
  setsid sh -c 'i=0; while [ $i -lt "$0" ]; do sleep 3600 & i=$((i+1)); done; wait' "$3" &
  p=$((p+1))
done
while [ "$(wc -l < "$1/cgroup.procs")" -lt $(($2 * $3 + $2)) ]; do sleep 0.2; done
echo started > "$4"
wait
"""


def start_crowd(factory: CgroupFactory, work: Path, parents: int,
                children: int) -> subprocess.Popen[bytes]:
    """`parents` x `children` sleeping processes in a cgroup of their own (killed, by PID,
    by the factory's cleanup)."""
    crowd = factory.make(f"crowd-{parents}x{children}", None)
    flag = work / "crowd.started"
    flag.unlink(missing_ok=True)
    spawner = subprocess.Popen(["sh", "-c", CROWD_SPAWNER, "sh", str(crowd.path), str(parents),
                                str(children), str(flag)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    if not wait_until(flag.exists, 300, interval=0.2):
        raise TimeoutError(f"{parents * children} processes did not start within 300 s")
    return spawner


def stop_crowd(factory: CgroupFactory, spawner: subprocess.Popen[bytes]) -> None:
    spawner.kill()
    spawner.wait(timeout=30)
    factory.cleanup()
    factory.created.clear()


def full_walk_ms(runs: int) -> list[float]:
    """The baseline: every process read, then the system rule's policy."""
    reader = ProcReader()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        rank_victims(system_candidates(reader.processes(reader.all_pids()), frozenset()))
        times.append((time.perf_counter() - began) * 1000)
    return times


def cgroup_rule(factory: CgroupFactory, work: Path, runs: int) -> dict[str, Any]:
    hot = factory.make("victims-hot", 256 * MiB)
    store = work / "store-victims"
    config = guard_config(work / "victims.toml", store, [str(hot.path)], threshold="50%")
    daemon = Daemon(store, config, work / "victims.log")
    events = daemon.start()
    choose, frozen = [], []
    try:
        wait_for_ready(events, 1)
        for index in range(runs):
            events.poll()
            mark = len(events.seen)
            hog = start_hog(hot.path, work, f"victim-{index}", target_mib=200,
                            rate=500 * 1e6 / MiB)
            try:
                stopped = events.wait("victim.frozen", 60, {"pid": hog.proc.pid}, after=mark)
                done = events.wait("checkpoint.done", 60, {"pid": hog.proc.pid}, after=mark)
                shutil.rmtree(done["path"], ignore_errors=True)
            finally:
                hog.kill()
            choose.append(float(stopped["choose_ms"]))
            frozen.append(float(stopped["detect_to_frozen_ms"]))
    finally:
        daemon.stop()
        shutil.rmtree(store, ignore_errors=True)
    return {"choose_ms": summary(choose), "detect_to_frozen_ms": summary(frozen)}


def system_rule(factory: CgroupFactory, work: Path, runs: int) -> dict[str, Any]:
    """A dry-run system rule whose floor a 1 GiB hog crosses (the floor is set 256 MiB below
    what is available when each run starts). MemAvailable moves by itself (page cache written
    back and reclaimed): a run whose hog did not take it below the floor is counted as missed,
    not taken for a result."""
    hot = factory.make("victims-sys", None)
    choose = []
    missed = 0
    for index in range(runs):
        store = work / f"store-victims-sys-{index}"
        floor = psutil.virtual_memory().available - 256 * MiB
        config = work / f"victims-sys-{index}.toml"
        config.write_text(f'[daemon]\nstore = "{store}"\ndry_run = true\n\n[[guard]]\n'
                          f"system = true\nmin_available = {floor}\npsi = false\n")
        daemon = Daemon(store, config, work / f"victims-sys-{index}.log")
        events = daemon.start()
        hog = None
        try:
            wait_for_ready(events, 1)
            time.sleep(2.5)  # in the zone from the start: the ranking is kept (every 1 s)
            events.poll()
            mark = len(events.seen)
            hog = start_hog(hot.path, work, f"victim-sys-{index}", target_mib=1024,
                            rate=1000 * 1e6 / MiB)
            try:
                chosen = events.wait("victim.chosen", 60, after=mark)
            except TimeoutError:
                missed += 1
                continue
            choose.append(float(chosen["choose_ms"]))
        finally:
            if hog is not None:
                hog.kill()
            daemon.stop()
            shutil.rmtree(store, ignore_errors=True)
    return {"choose_ms": summary(choose), "runs_missed": missed}


def victim_choice(factory: CgroupFactory, work: Path, crowd_size: int,
                  runs: int) -> dict[str, Any]:
    """With `crowd_size` processes spread over a hundredth as many parents (as on a busy
    node), then all children of one parent (the worst case for a system rule: that family is
    a candidate tree of its own)."""
    spawner = start_crowd(factory, work, max(1, crowd_size // 100), 100)
    try:
        processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
        result = {"processes_on_machine": processes, "crowd": crowd_size,
                  "full_walk_ms": summary(full_walk_ms(runs)),
                  "cgroup_rule": cgroup_rule(factory, work, runs),
                  "system_rule": system_rule(factory, work, max(3, runs // 2))}
    finally:
        stop_crowd(factory, spawner)
    spawner = start_crowd(factory, work, 1, crowd_size)
    try:
        result["one_parent"] = {"full_walk_ms": summary(full_walk_ms(3)),
                                "system_rule": system_rule(factory, work, 3)}
    finally:
        stop_crowd(factory, spawner)
    return result
