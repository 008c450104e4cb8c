"""Fork-storm drill on the real kernel with the real CRIU: a tree forking ~1000 children a
second (children that live tens of milliseconds, half of them forking in turn) outgrows its
cgroup and is frozen completely through the kernel's process-event connector: no process of
it runs after the freeze, every process it started is in the images or had ended before the
freeze, nothing is left in the cgroup or anywhere, and the restored tree goes on forking."""

from __future__ import annotations

import os
import signal
import struct
import sys
from datetime import datetime
from pathlib import Path

import pytest

from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    kill_pid,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
FORKSTORM = REPO / "tests" / "workloads" / "forkstorm.py"
IMG_COMMON_MAGIC, PSTREE_MAGIC = 0x54564319, 0x50273030  # criu/include/magic.h


def image_pids(images: Path) -> list[int]:
    """The pids of pstree.img: after the two magics, (u32 size, PstreeEntry) pairs; field 1
    of each entry (a varint) is the pid."""
    raw = (images / "pstree.img").read_bytes()
    assert struct.unpack_from("=II", raw) == (IMG_COMMON_MAGIC, PSTREE_MAGIC)
    pids, offset = [], 8
    while offset < len(raw):
        (size,) = struct.unpack_from("=I", raw, offset)
        entry, offset = raw[offset + 4:offset + 4 + size], offset + 4 + size
        assert entry[0] == 0x08  # field 1, varint
        value, shift, index = 0, 0, 1
        while True:
            byte = entry[index]
            value |= (byte & 0x7F) << shift
            index, shift = index + 1, shift + 7
            if not byte & 0x80:
                break
        pids.append(value)
    return pids


def parse_log(text: str) -> list[tuple[str, int, float]]:
    """(kind, pid, time) of every complete line the storm wrote."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0] in ("start", "exit", "grow"):
            found.append((fields[0], int(fields[1]), float(fields[-1])))
    return found


def running_with(token: str) -> list[int]:
    """Live processes anywhere whose command line names `token` (the storm's log)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if token.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def test_a_fork_storm_is_frozen_completely(cgroups: CgroupFactory, store: Path,
                                          tmp_path: Path) -> None:
    cg = cgroups.make("forkstorm", 256 * MiB)
    log = tmp_path / "storm.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                "--threshold", "85%") as guard:
        started = guard.wait_event("guard.started", timeout=60)[0]
        if not started["process_events"].startswith("kernel connector"):
            pytest.skip(f"no process events here: {started['process_events']}")
        guard.wait_event("guard.armed", timeout=60)
        storm = start_in_cgroup(cg, [sys.executable, str(FORKSTORM), str(log), "300", "1000",
                                     "2.0", "60"])
        try:
            done = guard.wait_event("checkpoint.done", timeout=240)[0]
            assert storm.wait(timeout=60) == -signal.SIGKILL
        finally:
            kill_pid(storm.pid)
        frozen = guard.events("victim.frozen")[0]
        assert not guard.events("checkpoint.failed")
    root = storm.pid
    assert done["pid"] == root
    # The freeze took the event path and kept every task in the tree.
    assert frozen["freeze"] == "connector", frozen
    assert "left_tree" not in frozen and "freeze_fallback" not in frozen
    assert "all_stopped" not in frozen
    # What the storm wrote before the restore; the freeze was complete when victim.frozen
    # was logged (after the wait for every task to stop).
    frozen_at = datetime.fromisoformat(frozen["timestamp"]).timestamp()
    lines = parse_log(log.read_text())
    starts = {pid for kind, pid, _t in lines if kind == "start"}
    exits = {pid: t for kind, pid, t in lines if kind == "exit"}
    first = min(t for _k, _p, t in lines)
    before = [t for kind, _p, t in lines if kind == "start" and t <= frozen_at]
    late = [(kind, pid, t - frozen_at) for kind, pid, t in lines if t > frozen_at]
    assert not late, f"ran after the freeze: {late[:10]}"
    # Every process the storm started was dumped, or had ended before the freeze.
    dumped = set(image_pids(Store(store).images_of(done["id"])))
    unaccounted = sorted(pid for pid in starts if pid not in dumped and pid not in exits)
    assert not unaccounted, f"neither dumped nor ended: {unaccounted[:20]}"
    assert all(exits[pid] <= frozen_at for pid in starts - dumped)
    assert root in dumped and len(dumped) > 2
    # The frozen tree (meta.json's pids) is exactly what CRIU found and dumped.
    assert sorted(Store(store).get(done["id"]).pids) == sorted(dumped)
    # Nothing of it is left, in the cgroup or anywhere; its memory is back.
    assert wait_until(lambda: not cg.procs(), 30), f"left in the cgroup: {cg.procs()}"
    assert running_with(str(log)) == []
    snap = cg.snapshot()
    assert snap.oom_kills == 0
    assert wait_until(lambda: cg.snapshot().usage_bytes < 64 * MiB, 30), cg.snapshot()
    print(f"\nfork storm: {len(before)} processes started in "
          f"{frozen_at - first:.1f} s before the freeze ({len(before) / (frozen_at - first):.0f}/s), "
          f"{frozen['forks_caught']} stopped on their fork event, {len(dumped)} dumped, "
          f"{len(starts - dumped)} ended before the freeze, 0 escaped; "
          f"detect-to-frozen {frozen['detect_to_frozen_ms']} ms, freeze {done['freeze_s']} s")

    # The restored tree goes on: the same root, new children, the grower growing. CRIU
    # restores the original pids: the dumped tasks' zombies, reparented to PID 1 as the
    # tree died, must have been reaped (some inits take their time).
    assert wait_until(lambda: not [p for p in dumped if os.path.exists(f"/proc/{p}")], 180), \
        f"zombies of the dumped tree not reaped: {[p for p in dumped if os.path.exists(f'/proc/{p}')]}"
    big = cgroups.make("forkstormbig", 1024 * MiB)  # the images: ~8 MiB each child, the grower
    restored = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert restored.returncode == 0, restored.stderr
    try:
        def after_restore() -> list[tuple[str, int, float]]:
            return [e for e in parse_log(log.read_text()) if e[2] > frozen_at]

        assert wait_until(lambda: sum(1 for k, p, _t in after_restore()
                                      if k == "start" and p not in starts) > 50, 60)
        assert wait_until(lambda: any(k == "grow" for k, _p, _t in after_restore()), 60)
        assert root in big.procs()
    finally:
        kill_pid(root)
        for pid in big.procs():
            kill_pid(pid)
