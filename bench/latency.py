"""Detection latency: from the moment a hog's cgroup crosses the threshold to the moment the
daemon has the victim stopped (its `victim.frozen` event), per allocation rate. The hog reads
its cgroup's usage around every allocation step (2 MiB, at full speed, then a pause that keeps
the rate) and stamps the wall-clock time before each step that may cross: the crossing
happened inside the last step stamped, so the latency is measured from that step's start (an
upper bound: it includes the part of the step before the crossing). The stamp after the step
('cross') cannot be used: the daemon often stops the hog inside that step, before it writes it.

Two guards on the same hogs in the same run: oomguard on kernel notifications (the default),
and the baseline, oomguard polling usage every 100 ms (`events = false`): the same actuator,
only the detection differs. The victim is then checkpointed as usual."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import Daemon, EventLog, event_time, guard_config, start_hog, summary
from tests.helpers import CgroupFactory, MiB, wait_until

LIMIT = 256 * MiB
THRESHOLD = 0.5  # 128 MiB: the hog (target 200 MiB) crosses it and is stopped well before the limit
TARGET_MIB = 200
MB = 1_000_000


def mib_per_s(mb_per_s: float) -> float:
    return mb_per_s * MB / MiB


def measure(events: EventLog, cgroup: Path, work: Path, name: str, rate_mb: float,
            timeout: float = 60) -> dict[str, Any]:
    """One hog at `rate_mb` MB/s: threshold crossing to stopped, in ms."""
    events.poll()
    mark = len(events.seen)
    hog = start_hog(cgroup, work, name, target_mib=TARGET_MIB, rate=mib_per_s(rate_mb),
                    cross_at=int(LIMIT * THRESHOLD))
    try:
        frozen = events.wait("victim.frozen", timeout, {"pid": hog.proc.pid}, after=mark)
        done = events.wait("checkpoint.done", timeout, {"pid": hog.proc.pid}, after=mark)
        shutil.rmtree(done["path"], ignore_errors=True)  # not needed: keep the disk free
    finally:
        hog.kill()
    marks = hog.marks()
    began = marks["step"]  # the allocation step that crossed began here
    allocated = began.get("allocated", 0)
    seconds = began["t"] - marks["start"]["t"]
    return {
        "latency_ms": (event_time(frozen) - began["t"]) * 1000,
        "detect_to_frozen_ms": frozen.get("detect_to_frozen_ms"),
        "achieved_mb_per_s": allocated / MB / seconds if seconds > 0 else None,
    }


def run_guard(factory: CgroupFactory, work: Path, label: str, rates: list[float], runs: int,
              poll: bool, extra_cgroups: int = 0, nice: int | None = None) -> dict[str, Any]:
    """One daemon guarding the hog's cgroup (and `extra_cgroups` idle ones), `runs` hogs per
    rate in turn; `nice`: its daemon.nice (None: the default)."""
    hot = factory.make(f"{label}-hot", LIMIT)
    idle = [factory.make(f"{label}-{i:04d}", LIMIT) for i in range(extra_cgroups)]
    store = work / f"store-{label}"
    settings: dict[str, str | bool] = {"threshold": f"{THRESHOLD:.0%}"}
    if poll:
        settings["events"] = False
    config = guard_config(work / f"{label}.toml", store,
                          [str(hot.path), *(str(c.path) for c in idle)], **settings)
    if poll:
        text = config.read_text().replace("[daemon]\n", '[daemon]\npoll_interval = "100ms"\n')
        config.write_text(text)
    if nice is not None:
        config.write_text(config.read_text().replace("[daemon]\n", f"[daemon]\nnice = {nice}\n"))
    daemon = Daemon(store, config, work / f"{label}.log")
    events = daemon.start()
    results: dict[str, Any] = {}
    try:
        wait_for_ready(events, 1 + extra_cgroups, marks=not poll)
        for rate in rates:
            samples = [measure(events, hot.path, work, f"{label}-{rate:g}-{i}", rate)
                       for i in range(runs)]
            latencies = [s["latency_ms"] for s in samples]
            achieved = [s["achieved_mb_per_s"] for s in samples if s["achieved_mb_per_s"]]
            results[f"{rate:g}"] = {
                "rate_mb_per_s": rate,
                "achieved_mb_per_s": summary(achieved)["median"] if achieved else None,
                "latency_ms": summary(latencies),
                "detect_to_frozen_ms": summary([float(s["detect_to_frozen_ms"] or 0)
                                                for s in samples]),
                "samples_ms": [round(v, 2) for v in latencies],
            }
    finally:
        daemon.stop()
        shutil.rmtree(store, ignore_errors=True)
    return results


def wait_for_ready(events: EventLog, count: int, timeout: float = 300,
                   marks: bool = False) -> None:
    """Until the daemon says guard.ready (READY=1: every guard armed, every cgroup looked at
    once) with `count` guards armed; a crossing before that measures the start-up. `marks`:
    and until the v1 marks beyond the threshold are in (guard.marks_added: the start is over,
    and what follows measures the guard as it runs)."""
    wanted = {"guard.ready", "guard.marks_added"} if marks else {"guard.ready"}

    def ready() -> bool:
        events.poll()
        return wanted <= {e.get("event") for e in events.seen}

    if not wait_until(ready, timeout, interval=0.05):
        raise TimeoutError(f"the daemon was not ready within {timeout}s")
    [said] = [e for e in events.seen if e.get("event") == "guard.ready"]
    if said.get("guards") != count:
        raise RuntimeError(f"{said.get('guards')} guards armed, not {count}")


def detection_latency(factory: CgroupFactory, work: Path, rates: list[float],
                      runs: int) -> dict[str, Any]:
    return {
        "events": run_guard(factory, work, "events", rates, runs, poll=False),
        "poll_100ms": run_guard(factory, work, "poll", rates, runs, poll=True),
    }


def scale_latency(factory: CgroupFactory, work: Path, rates: list[float], runs: int,
                  cgroups: int) -> dict[str, Any]:
    """Detection latency with `cgroups` guarded cgroups, one of them under pressure, per rate."""
    return {"cgroups": cgroups, **run_guard(factory, work, f"scale{cgroups}", rates, runs,
                                            poll=False, extra_cgroups=cgroups - 1)}


@contextmanager
def busy_machine(work: Path, burners: int) -> Iterator[None]:
    """`burners` shell loops spinning (one per CPU: the job's own threads, a build) and one
    writer (dd of 256 MiB with fsync, over and over) while the block runs; all started here and
    killed by PID afterwards."""
    loads = [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True)
             for _ in range(burners)]
    target = work / "busy-writer.bin"
    loads.append(subprocess.Popen(
        ["sh", "-c", f"while :; do dd if=/dev/zero of={target} bs=1M count=256 conv=fsync "
         "status=none; done"], start_new_session=True))
    try:
        yield
    finally:
        for load in loads:
            load.kill()
            load.wait()
        target.unlink(missing_ok=True)


def contended_latency(factory: CgroupFactory, work: Path, rate: float,
                      runs: int) -> dict[str, Any]:
    """Detection at `rate` on busy CPUs: the guard at the ordinary priority (daemon.nice = 0,
    the baseline) and at the default, under the same load, in turn."""
    burners = os.cpu_count() or 2
    with busy_machine(work, burners):
        ordinary = run_guard(factory, work, "busy-nice0", [rate], runs, poll=False, nice=0)
        raised = run_guard(factory, work, "busy-default", [rate], runs, poll=False)
    return {"burners": burners, "writer": True, "nice_0": ordinary[f"{rate:g}"],
            "default": raised[f"{rate:g}"]}
