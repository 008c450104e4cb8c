"""The core promise on the real kernel with the real CRIU: a hog that outgrows its memory cgroup
is checkpointed instead of OOM-killed, and comes back where it was. Runs on the host (cgroup v1)
and, unchanged, inside the VM lane on a real cgroup v2 kernel (tests/integration/test_v2_lane.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from oomguard.cgroup.mounts import read_layout
from oomguard.store.checkpoints import Store
from tests.helpers import (
    HIGH_PENALTY_MAX_MS,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    oomguard_argv,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def _done_line(log: Path) -> str | None:
    lines = log.read_text().splitlines() if log.exists() else []
    return next((line for line in lines if line.startswith("done")), None)


@pytest.mark.parametrize("rate", [100, 1000], ids=["100MBps", "1GBps"])
def test_hog_is_checkpointed_not_killed_and_restores_into_bigger_cgroup(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, rate: int) -> None:
    small = cgroups.make("small", 256 * MiB)
    big = cgroups.make("big", 768 * MiB)
    log = tmp_path / "hog.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path),
                "--threshold", "85%") as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(small, hog_argv(log, target=400, rate=rate, count=250))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        # CRIU kills the tree once the images are durable: the hog is gone, not OOM-killed.
        assert hog.wait(timeout=10) == -signal.SIGKILL
        assert done["pid"] == hog.pid
        frozen = guard.events("victim.frozen")[0]
        penalty = HIGH_PENALTY_MAX_MS if read_layout().memory_version == 2 else 0
        assert frozen["detect_to_frozen_ms"] < 1000 + penalty, frozen
    snap = small.snapshot()
    assert snap.oom_kills == 0, "the kernel OOM killer fired"
    assert snap.usage_bytes < 16 * MiB, f"memory not freed: {snap.usage_bytes} bytes in use"
    meta = Store(store).get(done["id"])
    assert meta.state == "checkpointed" and meta.image_bytes > 200 * MiB
    before = last_count(log)
    assert before > 0

    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert pid in big.procs()
        assert wait_until(lambda: _done_line(log), timeout=60), log.read_text()[-500:]
        assert _done_line(log) == "done 250 ok"  # memory intact after the round trip
        counts = read_counts(log)
        assert counts == list(range(1, 251)), "the count restarted or skipped"
        assert big.snapshot().oom_kills == 0
        assert Store(store).get(done["id"]).state == "restored"
    finally:
        kill_pid(pid)


def test_without_a_guard_the_kernel_kills_the_hog(cgroups: CgroupFactory, tmp_path: Path) -> None:
    """Proves the pressure in the test above is real."""
    small = cgroups.make("small", 256 * MiB)
    hog = start_in_cgroup(small, hog_argv(tmp_path / "hog.log", target=400, rate=1000, count=250))
    assert hog.wait(timeout=60) == -signal.SIGKILL
    assert small.snapshot().oom_kills >= 1


def test_process_tree_with_children_and_open_files_round_trip(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("tree", 512 * MiB)
    log = tmp_path / "tree.log"
    # 30 s of life: in the emulated v2 lane the CLI alone takes seconds to start, and a job
    # that ends its count during the dump is gone before CRIU is done ("No such process":
    # seen with 15 s while the host ran the whole suite beside the lane).
    hog = start_in_cgroup(cg, hog_argv(log, target=64, rate=200, count=3000, tick=0.01,
                                      children=2))
    kids = [Path(f"{log}.child{i}") for i in range(2)]
    assert wait_until(lambda: last_count(log) > 20 and all(last_count(k) > 5 for k in kids), 20)

    result = run_oomguard(store, "checkpoint", str(hog.pid))
    assert result.returncode == 0, result.stderr
    checkpoint_id = result.stdout.strip()
    assert hog.wait(timeout=10) == -signal.SIGKILL
    meta = Store(store).get(checkpoint_id)
    assert len(meta.pids) == 3
    assert wait_until(lambda: not cg.procs(), 5), "tree still present after checkpoint"
    marks = [last_count(log)] + [last_count(k) for k in kids]
    assert cg.snapshot().usage_bytes < 16 * MiB

    result = run_oomguard(store, "restore", checkpoint_id)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert pid == hog.pid  # CRIU restores the same PIDs
        assert wait_until(lambda: all(last_count(k) > m + 5 for k, m in zip(kids, marks[1:],
                                                                          strict=True)), 20)
        assert wait_until(lambda: _done_line(log), 150) == "done 3000 ok"
        assert read_counts(log) == list(range(1, 3001))
        for kid in kids:  # each child continued its own count
            assert read_counts(kid) == list(range(1, len(read_counts(kid)) + 1))
    finally:
        for p in meta.pids:
            kill_pid(p)


def test_exec_workload_restores_in_its_own_pid_namespace(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    small = cgroups.make("exec", 256 * MiB)
    big = cgroups.make("execbig", 768 * MiB)
    log = tmp_path / "exec.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        # cwd: CRIU's parasite mounts a /proc of the namespace in a directory it makes in the
        # task's working directory, which must be writable (the VM lane's repo is read-only).
        wrapper = start_in_cgroup(None, [*oomguard_argv(store), "exec", "--cgroup", str(small.path),
                                         "--", *hog_argv(log, target=400, rate=300, count=150)],
                                  cwd=tmp_path)
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        wrapper.wait(timeout=10)
    meta = Store(store).get(done["id"])
    assert meta.pidns, "the victim should be the namespace's init"
    assert small.snapshot().oom_kills == 0
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: _done_line(log), 60) == "done 150 ok"
        assert read_counts(log) == list(range(1, 151))
    finally:
        kill_pid(pid)


def test_polling_fallback_catches_a_slow_hog(cgroups: CgroupFactory, store: Path,
                                             tmp_path: Path) -> None:
    """Where eventfd notifications are unavailable (or turned off), polling still works."""
    small = cgroups.make("poll", 256 * MiB)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path), "--no-events",
                "--poll-interval", "50ms") as guard:
        armed = guard.wait_event("guard.armed")[0]
        assert armed["detection"].startswith("polling every 50")
        hog = start_in_cgroup(small, hog_argv(tmp_path / "hog.log", target=400, rate=100,
                                              count=100))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert guard.events("threshold.crossed")[0]["source"] == "poll"
        assert hog.wait(timeout=10) == -signal.SIGKILL
    assert done["pid"] == hog.pid
    assert small.snapshot().oom_kills == 0


def test_page_cache_alone_is_not_acted_on(cgroups: CgroupFactory, store: Path,
                                          tmp_path: Path) -> None:
    """A writer fills the cgroup with page cache (reclaimable): usage crosses the threshold,
    resident memory does not, and nothing is stopped."""
    small = cgroups.make("cache", 128 * MiB)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        writer = start_in_cgroup(small, ["dd", "if=/dev/zero", f"of={tmp_path / 'big.file'}",
                                         "bs=1M", "count=300"])
        assert writer.wait(timeout=60) == 0
        time.sleep(0.5)
        assert guard.events("threshold.cache_only"), "usage never crossed: the test proves nothing"
        assert not guard.events("threshold.crossed")
        assert not guard.events("checkpoint.done")
    assert small.snapshot().oom_kills == 0


def test_one_hog_after_another_with_rescans_during_the_dumps(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A dump lifts the limit for headroom; rescans (every 100 ms here) that read the lifted
    limit must not re-arm the thresholds on it, or the next hog meets no threshold below the
    real limit and the kernel kills it (found by bench/saverate.py)."""
    cg = cgroups.make("serial", 256 * MiB)
    config = tmp_path / "serial.toml"
    config.write_text(f'[daemon]\nrescan_interval = "100ms"\n\n[[guard]]\ncgroups = ["{cg.path}"]\n'
                      'threshold = "85%"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        for index in range(3):
            hog = start_in_cgroup(cg, hog_argv(tmp_path / f"hog{index}.log", target=400,
                                               rate=1000, count=100_000))
            done = guard.wait_event("checkpoint.done", timeout=60, count=index + 1)[index]
            assert done["pid"] == hog.pid
            hog.wait(timeout=10)
        armed = guard.events("guard.armed")
    assert cg.snapshot().oom_kills == 0
    assert {event["limit"] for event in armed} == {256 * MiB}, armed
