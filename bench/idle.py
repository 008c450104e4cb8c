"""Idle cost: CPU seconds and memory of `oomguard run` guarding 1, 100 and 1000 cgroups for the
same 60 s with nothing happening, side by side with earlyoom (Debian's package, its binary
extracted by scripts/bench, run with --dryrun so it can never kill anything here).

CPU time is the sum of every thread's sum_exec_runtime (/proc/PID/task/*/schedstat,
nanoseconds); utime+stime from /proc/PID/stat (10 ms ticks) is kept beside it as a check.
Idle costs are a millisecond or so a minute, and on this VM the host's steal lands in them
(a window where every process, earlyoom too, costs ten times more): each is the median of
`windows` consecutive windows, every window's figure kept beside it."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness import Daemon, EventLog, guard_config
from bench.latency import wait_for_ready
from tests.helpers import CgroupFactory, MiB

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_ticks_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def memory(pid: int) -> dict[str, float]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            number = int(value.split()[0])
            found[key] = number / 1024 if key != "Threads" else number
    return {"rss_mib": found.get("VmRSS", 0.0), "peak_rss_mib": found.get("VmHWM", 0.0),
            "threads": found.get("Threads", 0)}


def idle_cost(factory: CgroupFactory, work: Path, counts: list[int], seconds: float,
              earlyoom: Path | None, windows: int = 3) -> dict[str, Any]:
    cgroups = [factory.make(f"idle-{i:04d}", 256 * MiB) for i in range(max(counts))]
    daemons: dict[str, Daemon] = {}
    logs: dict[str, EventLog] = {}
    started: dict[str, float] = {}
    for count in counts:
        label = f"oomguard, {count} cgroup{'s' if count > 1 else ''}"
        store = work / f"store-idle-{count}"
        config = guard_config(work / f"idle-{count}.toml", store,
                              [str(c.path) for c in cgroups[:count]])
        daemons[label] = Daemon(store, config, work / f"idle-{count}.log")
        started[label] = time.monotonic()
        logs[label] = daemons[label].start()
    peers: dict[str, subprocess.Popen[bytes]] = {}
    if earlyoom is not None:
        # Debian's service runs it with EARLYOOM_ARGS="-r 3600"; --dryrun: it never kills here.
        peers["earlyoom -r 3600 --dryrun"] = subprocess.Popen(
            [str(earlyoom), "-r", "3600", "--dryrun"], stdin=subprocess.DEVNULL,
            stdout=open(work / "earlyoom.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    results: dict[str, Any] = {}
    try:
        startup: dict[str, dict[str, float]] = {}
        for label, count in zip(daemons, counts, strict=True):
            wait_for_ready(logs[label], count)
            pid = daemons[label].pid
            startup[label] = {"startup_s": time.monotonic() - started[label],
                              "startup_cpu_s": cpu_ns(pid) / 1e9}
        time.sleep(2)  # let start-up work settle (first rescan, heartbeat)
        pids = {label: d.pid for label, d in daemons.items()}
        pids.update({label: p.pid for label, p in peers.items()})
        samples: dict[str, list[tuple[float, float]]] = {label: [] for label in pids}
        elapsed = 0.0
        for _ in range(windows):
            before = {label: (cpu_ns(pid), cpu_ticks_s(pid)) for label, pid in pids.items()}
            start = time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - start
            for label, pid in pids.items():
                samples[label].append(((cpu_ns(pid) - before[label][0]) / 1e9,
                                       cpu_ticks_s(pid) - before[label][1]))
        for label, pid in pids.items():
            cpu = [c for c, _ in samples[label]]
            results[label] = {
                "seconds": round(elapsed, 2),
                "cpu_s": statistics.median(cpu),
                "cpu_s_windows": [round(c, 6) for c in cpu],
                "cpu_s_ticks": round(statistics.median(t for _, t in samples[label]), 2),
                **memory(pid), **startup.get(label, {}),
            }
    finally:
        for daemon in daemons.values():
            daemon.stop()
            shutil.rmtree(daemon.store, ignore_errors=True)
        for peer in peers.values():
            peer.terminate()
            peer.wait(timeout=10)
    return results
