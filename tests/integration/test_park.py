"""Memory taken inside one system call, which no SIGSTOP can interrupt: on default settings the
job is parked at its limit (v1 oom_kill_disable) or throttled (v2 memory.high), then
checkpointed, never OOM-killed. Runs on the host (v1) and in the v2 VM lane."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.store import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
POPULATE = REPO / "tests" / "workloads" / "populate.py"


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_map_populate_in_one_call_is_checkpointed_not_killed(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    small = cgroups.make("populate", 256 * MiB)
    log = tmp_path / "populate.log"
    config = tmp_path / "defaults.toml"  # a guard on default settings, nothing else
    config.write_text(f'[[guard]]\ncgroups = ["{small.path}"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        job = start_in_cgroup(small, [sys.executable, str(POPULATE), str(log), "400"])
        settled = wait_until(lambda: guard.events("checkpoint.done") or guard.events(
            "oom.kill_seen"), timeout=120)
        assert settled and settled[0]["event"] == "checkpoint.done", guard.log.read_text()[-4000:]
        done = settled[0]
        assert job.wait(timeout=30) == -signal.SIGKILL  # CRIU's kill after the dump
        assert done["pid"] == job.pid
    snap = small.snapshot()
    assert snap.oom_kills == 0, "the kernel OOM killer fired"
    assert snap.usage_bytes < 16 * MiB
    assert not any(line.startswith("done") for line in _lines(log))
    assert Store(store).get(done["id"]).image_bytes > 128 * MiB

    big = cgroups.make("populatebig", 768 * MiB)
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        finished = wait_until(lambda: [x for x in _lines(log) if x.startswith(("done", "corrupt"))],
                              timeout=120)
        assert finished == [f"done {400 * MiB // 4096} pages"], (_lines(log), proc_state(pid))
        assert _lines(log)[0] == f"start {job.pid} 400"
        assert big.snapshot().oom_kills == 0
    finally:
        kill_pid(pid)


def test_task_parked_before_the_daemon_starts_is_checkpointed_and_restores(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A hog already waiting at the limit (oom_kill_disable left on: a daemon died while it
    grew) is checkpointed at the next start, and the restored hog goes on where it was."""
    small = cgroups.make("parked", 256 * MiB)
    assert isinstance(small, V1MemoryCgroup)
    small.set_oom_kill_disable(True)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(small, hog_argv(log, target=400, rate=1000, count=250))
    assert wait_until(lambda: small.snapshot().under_oom, 60), "the hog never reached its limit"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert hog.wait(timeout=30) == -signal.SIGKILL
    assert small.snapshot().oom_kills == 0
    before = last_count(log)
    big = cgroups.make("parkedbig", 768 * MiB)
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: any(x.startswith("done") for x in _lines(log)), 60), (
            _lines(log)[-3:], proc_state(pid))
        assert read_counts(log) == list(range(1, 251)) and before > 0
    finally:
        kill_pid(pid)
