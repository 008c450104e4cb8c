"""Save rate: hogs that would outgrow their cgroup's limit, one after the other, at each
allocation rate up to the fastest this machine allocates. Each ends checkpointed (a complete
checkpoint on disk) or killed by the kernel's OOM killer (the cgroup's oom_kill count). The
baseline in the same run: the same hogs with no guard."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.harness import Daemon, EventLog, guard_config, start_hog
from bench.latency import mib_per_s, wait_for_ready
from oomguard.cgroup.v1 import V1MemoryCgroup
from tests.helpers import CgroupFactory, MiB

LIMIT = 256 * MiB
TARGET_MIB = 400  # over the limit: without a guard the kernel kills every one
UNTHROTTLED = 0.0  # "rate" label of hogs allocating as fast as they can


def oom_kills(cgroup: V1MemoryCgroup) -> int:
    return cgroup.snapshot().oom_kills


def one_hog(cgroup: V1MemoryCgroup, work: Path, name: str, rate_mb: float,
            events: EventLog | None) -> str:
    """'checkpointed', 'killed' (by the kernel) or 'other' (what, then, is in the log)."""
    before = oom_kills(cgroup)
    mark = len(events.seen) if events else 0
    rate = mib_per_s(rate_mb) if rate_mb else 1e6
    hog = start_hog(cgroup.path, work, name, target_mib=TARGET_MIB, rate=rate, chunk=4)
    try:
        hog.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        hog.kill()
        return "other"
    if events is not None:
        try:
            done = events.wait("checkpoint.done", 30, {"pid": hog.proc.pid}, after=mark)
            shutil.rmtree(done["path"], ignore_errors=True)
            return "checkpointed"
        except TimeoutError:
            pass
    return "killed" if oom_kills(cgroup) > before else "other"


def run(factory: CgroupFactory, work: Path, rates: list[float], hogs: int,
        guarded: bool, settings: dict[str, str | bool] | None = None,
        label: str = "") -> dict[str, Any]:
    label = label or ("guarded" if guarded else "unguarded")
    cgroup = factory.make(f"save-{label}", LIMIT)
    assert isinstance(cgroup, V1MemoryCgroup)
    daemon = None
    events = None
    if guarded:
        store = work / f"store-save-{label}"
        config = guard_config(work / f"save-{label}.toml", store, [str(cgroup.path)],
                              **(settings or {}))
        daemon = Daemon(store, config, work / f"save-{label}.log")
        events = daemon.start()
        wait_for_ready(events, 1)
    results: dict[str, Any] = {}
    try:
        for rate in rates:
            outcomes = [one_hog(cgroup, work, f"save-{label}-{rate:g}-{i}", rate, events)
                        for i in range(hogs)]
            results["max" if rate == UNTHROTTLED else f"{rate:g}"] = {
                "rate_mb_per_s": rate or None,
                "hogs": hogs,
                "checkpointed": outcomes.count("checkpointed"),
                "killed": outcomes.count("killed"),
                "other": outcomes.count("other"),
            }
    finally:
        if daemon is not None:
            daemon.stop()
            shutil.rmtree(daemon.store, ignore_errors=True)
    return results


def save_rate(factory: CgroupFactory, work: Path, rates: list[float],
              hogs: int) -> dict[str, Any]:
    return {
        "no_guard": run(factory, work, rates, hogs, guarded=False),
        "oomguard_default": run(factory, work, rates, hogs, guarded=True),
        "oomguard_oom_kill_disable": run(factory, work, rates, hogs, guarded=True,
                                         settings={"oom_kill_disable": True},
                                         label="okd"),
    }
