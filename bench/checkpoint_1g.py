"""Benchmark: a ~1 GiB hog caught at 85% of a 1.2 GiB memory cgroup limit.

Measures, per run: threshold-event-to-frozen (ms), dump seconds and MB/s, restore seconds; and,
as the baseline in the same run, a sequential write + fdatasync of the same size to the same
filesystem (what the disk can do), so dump MB/s is reported as a ratio.

    .venv/bin/python bench/checkpoint_1g.py [--runs 3] [--json out.json]
Needs root, the cgroup v1 memory controller and CRIU (scripts/setup).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import (
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    own_memory_cgroup,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

LIMIT = 1228 * MiB  # 1.2 GiB: 85% is 1.02 GiB
TARGET_MIB = 1150


def disk_baseline(directory: Path, size: int, uniform: bool = True) -> float:
    """MB/s of writing `size` bytes sequentially, then fdatasync, then dropping the cache.
    `uniform`: the same kind of data as the hog's pages (each chunk one repeated byte), since a
    virtual disk may store uniform blocks faster than random ones."""
    block = bytes([7]) * (1 << 20) if uniform else os.urandom(1 << 20)
    path = directory / "baseline.bin"
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size >> 20):
            os.write(fd, block)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    seconds = time.monotonic() - start
    path.unlink()
    return size / 1e6 / seconds


def one_run(factory: CgroupFactory, work: Path, index: int) -> dict[str, float]:
    small = factory.make(f"b{index}", LIMIT)
    big = factory.make(f"b{index}big", LIMIT + 256 * MiB)
    store = work / f"store{index}"
    log = work / f"hog{index}.log"
    with daemon(store, work / f"daemon{index}.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(small, hog_argv(log, target=TARGET_MIB, rate=1000, count=400,
                                              chunk=8))
        done = guard.wait_event("checkpoint.done", timeout=120)[0]
        frozen = guard.events("victim.frozen")[0]
        hog.wait(timeout=30)
    oom_kills = small.snapshot().oom_kills
    usage_after = small.snapshot().usage_bytes
    start = time.monotonic()
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    restore_s = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    pid = int(result.stdout.strip())
    ok = wait_until(lambda: "done 400 ok" in log.read_text(), 60)
    kill_pid(pid)
    factory.cleanup()
    factory.created.clear()
    return {
        "image_mib": done["image_bytes"] / MiB,
        "detect_to_frozen_ms": frozen["detect_to_frozen_ms"],
        "dump_s": done["dump_s"],
        "checkpoint_total_s": done["seconds"],
        "dump_mb_per_s": done["mb_per_s"],
        "restore_cli_s": restore_s,
        "oom_kills": oom_kills,
        "usage_after_mib": usage_after / MiB,
        "resumed_ok": bool(ok),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    parent = own_memory_cgroup()
    if parent is None or os.geteuid() != 0:
        print("needs root and the cgroup v1 memory controller", file=sys.stderr)
        return 77
    factory = CgroupFactory(parent=parent, tag=f"bench-{os.getpid()}")
    runs = []
    baselines = []
    random_baselines = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        work = Path(tmp)
        try:
            for index in range(args.runs):
                baselines.append(disk_baseline(work, 1024 * MiB))
                random_baselines.append(disk_baseline(work, 1024 * MiB, uniform=False))
                runs.append(one_run(factory, work, index))
        finally:
            factory.cleanup()
    summary = {key: statistics.median(r[key] for r in runs)
               for key in runs[0] if isinstance(runs[0][key], float | int)}
    summary["disk_write_fdatasync_mb_per_s"] = statistics.median(baselines)
    summary["disk_random_write_fdatasync_mb_per_s"] = statistics.median(random_baselines)
    summary["dump_vs_disk_ratio"] = summary["dump_mb_per_s"] / summary["disk_write_fdatasync_mb_per_s"]
    print(f"{'metric':32} " + " ".join(f"run{i + 1:>10}" for i in range(len(runs))) + "     median")
    for key in runs[0]:
        values = " ".join(f"{float(r[key]):>13.2f}" for r in runs)
        print(f"{key:32} {values} {float(summary.get(key, 0)):>10.2f}")
    print(f"{'disk_write_fdatasync_mb_per_s':32} "
          + " ".join(f"{b:>13.1f}" for b in baselines)
          + f" {summary['disk_write_fdatasync_mb_per_s']:>10.1f}")
    print(f"{'disk_random_write_fdatasync_mb_per_s':32} "
          + " ".join(f"{b:>13.1f}" for b in random_baselines)
          + f" {summary['disk_random_write_fdatasync_mb_per_s']:>10.1f}")
    print(f"dump MB/s / disk MB/s, same data kind, same run: {summary['dump_vs_disk_ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "baseline_mb_per_s": baselines,
                                         "random_baseline_mb_per_s": random_baselines,
                                         "median": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
