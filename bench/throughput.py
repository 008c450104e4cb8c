"""Checkpoint and restore throughput for 256 MiB, 1 GiB and 2 GiB of memory (2 GiB: two
1 GiB hogs under one parent, dumped as one tree), against what the disk does in the same run:
a sequential write + fdatasync of a file the size of the image to the same filesystem (dump),
a cold sequential read of it (restore), each measured twice just before every checkpoint and
taken as the median of all of a size's runs (the shared VM's disk swings 2-3x between runs).
Restore is timed from its first check to the tree running, verification included. Where a
dump's time goes comes from oomguard's own timings, CRIU's dump.log (its timestamps, and the
line the post-dump hook prints) and CRIU's stats-dump image (memdump/memwrite). For
comparison, the same run times what the commit used to do: read every image back cold and
SHA-256 it."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import cli_result, disk_read, disk_read_into_new_memory, disk_write
from oomguard.store.pagemap import message_fields, message_numbers
from tests.helpers import HOG, CgroupFactory, MiB, kill_pid, wait_until

MB = 1_000_000
LOG_LINE = re.compile(r"^\((\d+\.\d+)\) (.*)$")
HOOK_LINE = re.compile(r"oomguard criu hook: (\d+) bytes, fdatasync ([\d.]+) s, "
                       r"(?:digests .* after ([\d.]+) s, )?page cache dropped ([\d.]+) s")
BASELINE_RUNS = 2  # of each disk baseline, before every checkpoint


def criu_stats(images: Path) -> dict[str, float]:
    """memdump/memwrite seconds and pages written, from CRIU's stats-dump (8 bytes of magic,
    a 4-byte size, then a stats_entry whose field 1 is the dump_stats_entry)."""
    data = (images / "stats-dump").read_bytes()
    size = int.from_bytes(data[8:12], "little")
    entry = message_fields(data[12:12 + size]).get(1)
    if not isinstance(entry, bytes):
        raise ValueError("stats-dump holds no dump_stats_entry")
    dump = message_numbers(entry)
    return {"freezing_s": dump[1] / 1e6, "frozen_s": dump[2] / 1e6,
            "memdump_s": dump[3] / 1e6, "memwrite_s": dump[4] / 1e6,
            "pages_written": dump.get(7, 0)}


def dump_log_marks(images: Path) -> dict[str, float]:
    marks: dict[str, float] = {}
    wanted = {"seized": "Seized task", "post_dump": "Running post-dump scripts",
              "unfreeze": "Unfreezing tasks", "end": "Dumping finished successfully"}
    for line in (images / "dump.log").read_text(errors="replace").splitlines():
        hook = HOOK_LINE.search(line)
        if hook:
            marks["hook_sync_s"] = float(hook.group(2))
            marks["hook_digest_wait_s"] = float(hook.group(3) or 0.0)
            marks["hook_drop_s"] = float(hook.group(4))
            continue
        match = LOG_LINE.match(line)
        if not match:
            continue
        for key, text in wanted.items():
            if key not in marks and match.group(2).startswith(text):
                marks[key] = float(match.group(1))
    return marks


def breakdown(cli: dict[str, Any], images: Path) -> dict[str, float]:
    """Seconds per phase of one checkpoint; the phases add up to its total."""
    log = dump_log_marks(images)
    stats = criu_stats(images)
    sync = log.get("hook_sync_s", 0.0)
    wait = log.get("hook_digest_wait_s", 0.0)
    drop = log.get("hook_drop_s", 0.0)
    phases = {
        "freeze (SIGSTOP, all stopped)": cli["freeze_s"],
        "CRIU start, seize": log["seized"],
        "memory: pages drained": stats["memdump_s"] - stats["memwrite_s"],
        "memory: pages written": stats["memwrite_s"],
        "CRIU other (files, fds, images)": log["post_dump"] - log["seized"] - stats["memdump_s"],
        "fdatasync": sync,
        "waiting for the digests": wait,
        "page cache dropped": drop,
        "hook start, kill, CRIU exit": log["end"] - log["post_dump"] - sync - wait - drop,
        "wait for exit": cli["dump_s"] - log["end"],
        "commit (checksums, meta)": cli["commit_s"],
    }
    return {key: round(max(value, 0.0), 4) for key, value in phases.items()}


def start_tree(cgroup: Path, work: Path, name: str, mib: int, processes: int,
               ) -> tuple[subprocess.Popen[bytes], list[Path]]:
    """`processes` hogs of `mib // processes` MiB each, as fast as they allocate, under one
    shell (the tree root)."""
    per = mib // processes
    logs = [work / f"{name}-{i}.log" for i in range(processes)]
    stamps = [work / f"{name}-{i}.stamps" for i in range(processes)]
    for path in logs + stamps:
        path.unlink(missing_ok=True)
    hogs = " ".join(
        f"{sys.executable} {HOG} --log {log} --target {per} --rate 1000000 --chunk 8 "
        f"--count 10000000 --tick 0.05 --stamps {stamp} &"
        for log, stamp in zip(logs, stamps, strict=True))
    script = f'echo $$ > "$0"; {hogs} wait'
    proc = subprocess.Popen(["/bin/sh", "-c", script, str(cgroup / "cgroup.procs")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, stamps


def _grown(stamps: list[Path]) -> list[dict[str, Any]] | None:
    found = []
    for path in stamps:
        marks = {}
        if path.exists():
            for line in path.read_text().splitlines():
                mark = json.loads(line)
                marks[mark["event"]] = mark
        if "grown" not in marks:
            return None
        found.append(marks)
    return found


def restore_read_s(log: Path) -> float | None:
    """Seconds CRIU's restorer spent in its preadv of the pages into the restored memory
    (restore.log: each "Preadv" line to the "returned" line after it), summed over tasks."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    total, began = 0.0, None
    for line in lines:
        mark = LOG_LINE.match(line)
        if mark is None:
            continue
        if "Preadv " in mark.group(2):
            began = float(mark.group(1))
        elif began is not None and "`- returned" in mark.group(2):
            total += float(mark.group(1)) - began
            began = None
    return total


def old_commit_s(images: Path) -> float:
    """What the commit did before checksums were taken during the dump: read every image back
    with a cold cache and SHA-256 it."""
    from oomguard.model.checksums import SHA256
    from oomguard.store.integrity import compute

    for path in images.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    start = time.monotonic()
    compute(images, SHA256)
    return time.monotonic() - start


def baselines(work: Path, size: int, runs: int) -> tuple[list[float], list[float], list[float]]:
    """MB/s of `runs` writes + fdatasync, cold reads, and cold reads into new memory (the
    floor of a restore: disk_read_into_new_memory) of a file of `size` bytes; the two reads
    of each file in turn, which one first alternating."""
    writes, reads, fresh = [], [], []
    for run in range(runs):
        writes.append(size / MB / disk_write(work, size))
        if run % 2:
            fresh.append(size / MB / disk_read_into_new_memory(work))
            reads.append(size / MB / disk_read(work))
        else:
            reads.append(size / MB / disk_read(work, keep=True))
            fresh.append(size / MB / disk_read_into_new_memory(work))
            (work / "baseline.bin").unlink()
    return writes, reads, fresh


def one_size(factory: CgroupFactory, work: Path, mib: int, processes: int,
             index: int) -> dict[str, Any]:
    name = f"tp{mib}-{index}"
    cgroup = factory.make(name, None)
    target = factory.make(f"{name}r", None)
    store = work / f"store-{name}"
    size = int(mib * MiB * 1.06)  # about the image's size (CRIU's images of the hogs)
    writes, reads, fresh = baselines(work, size, BASELINE_RUNS)
    proc, stamps = start_tree(cgroup.path, work, name, mib, processes)
    marks = wait_until(lambda: _grown(stamps), 120, interval=0.05)
    if not marks:
        proc.kill()
        raise RuntimeError(f"{name}: the hogs did not grow")
    alloc = [m["grown"]["allocated"] / MB / (m["grown"]["t"] - m["start"]["t"]) for m in marks]
    try:
        done = cli_result(store, "checkpoint", str(proc.pid), "--reason", "benchmark")[0]
        proc.wait(timeout=30)
        images = store / done["id"] / "images"
        phases = breakdown(done, images)
        old_commit = old_commit_s(images)
        started = time.monotonic()
        restored = cli_result(store, "restore", done["id"], "--cgroup", str(target.path))[0]
        restore_wall = time.monotonic() - started
        read_s = restore_read_s(store / done["id"] / "restore.log")
        logs = [Path(str(s).replace(".stamps", ".log")) for s in stamps]
        counts = [p.stat().st_size for p in logs]
        resumed = wait_until(lambda: all(p.stat().st_size > c for p, c in zip(logs, counts,
                                                                               strict=True)),
                             30)
    finally:
        for pid in target.procs() + cgroup.procs():
            kill_pid(pid)
        shutil.rmtree(store, ignore_errors=True)
    image = done["image_bytes"]
    total = restored.get("total_s") or restored["seconds"]
    return {
        "mib": mib, "processes": processes, "image_bytes": image,
        "allocation_mb_per_s": min(alloc),
        "checkpoint_s": done["seconds"], "dump_s": done["dump_s"],
        "commit_s": done["commit_s"], "old_commit_s": round(old_commit, 4),
        "dump_mb_per_s": image / MB / done["dump_s"],
        "disk_write_fdatasync_mb_per_s": statistics.median(writes),
        "disk_write_samples": [round(w) for w in writes],
        "restore_s": total, "restore_criu_s": restored["seconds"],
        "restore_verify_s": restored.get("verify_s"),
        "restore_wall_s": restore_wall,
        "restore_criu_read_s": read_s,
        "restore_mb_per_s": image / MB / total,
        "disk_cold_read_mb_per_s": statistics.median(reads),
        "disk_read_samples": [round(r) for r in reads],
        "new_memory_read_samples": [round(r) for r in fresh],
        "resumed": bool(resumed), "phases_s": phases,
    }


def size_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per size: medians of the runs and of every baseline sample taken around them."""
    writes = [w for r in rows for w in r.get("disk_write_samples", [])] or \
        [r["disk_write_fdatasync_mb_per_s"] for r in rows]
    reads = [x for r in rows for x in r.get("disk_read_samples", [])] or \
        [r["disk_cold_read_mb_per_s"] for r in rows]
    fresh = [x for r in rows for x in r.get("new_memory_read_samples", [])]
    dump = statistics.median(r["dump_mb_per_s"] for r in rows)
    restore = statistics.median(r["restore_mb_per_s"] for r in rows)
    commit = statistics.median(r.get("commit_s", r["phases_s"].get("commit (checksums, meta)", 0.0))
                               for r in rows)
    dump_s = statistics.median(r["dump_s"] for r in rows)
    read = [r["restore_criu_read_s"] for r in rows if r.get("restore_criu_read_s")]
    return {"dump_mb_per_s": dump, "disk_write_mb_per_s": statistics.median(writes),
            "restore_mb_per_s": restore, "disk_read_mb_per_s": statistics.median(reads),
            "dump_ratio": dump / statistics.median(writes),
            "restore_ratio": restore / statistics.median(reads),
            **({"new_memory_read_mb_per_s": statistics.median(fresh),
                "restore_to_new_memory": restore / statistics.median(fresh)} if fresh else {}),
            "commit_s": commit, "dump_s": dump_s, "commit_to_dump": commit / dump_s,
            **({"restore_criu_read_s": statistics.median(read),
                "restore_s": statistics.median(r["restore_s"] for r in rows)} if read else {}),
            "old_commit_s": statistics.median(r.get("old_commit_s", 0.0) for r in rows)}


def throughput(factory: CgroupFactory, work: Path, sizes: list[tuple[int, int]],
               repeats: int) -> list[dict[str, Any]]:
    """Sizes interleaved (256, 1024, 2048, 256, ...) so a slow spell of the shared disk does
    not land on one size only."""
    return [one_size(factory, work, mib, processes, index)
            for index in range(repeats) for mib, processes in sizes]
