"""A failed checkpoint never costs the process: it is thawed and keeps running (or, only when
configured, killed), and the event says which and why."""

from __future__ import annotations

import signal
import stat
import subprocess
from pathlib import Path

import pytest

from oomguard.store.checkpoints import Store
from tests.helpers import (
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)
from tests.integration.test_commit_failure import filling_criu

pytestmark = pytest.mark.integration

FAILING_CRIU = """#!/bin/sh
case "$1" in
  --version) echo "Version: 4.2.1" ;;
  check) echo "Looks good." ;;
  *) echo "Error (simulated): CRIU refuses to dump" >&2; exit 1 ;;
esac
"""


def _failing_criu(tmp_path: Path) -> Path:
    path = tmp_path / "criu-fails"
    path.write_text(FAILING_CRIU)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize("on_failure", ["thaw", "kill"])
def test_criu_failure_thaws_or_kills_as_configured(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, on_failure: str) -> None:
    """The checkpoint's own failure, with no page-out after it (`--actions checkpoint` or
    `checkpoint,kill`; the default chain's page-out: tests/integration/test_pageout_*.py)."""
    cg = cgroups.make("fail", 256 * MiB)
    log = tmp_path / "hog.log"
    # Crosses the 50% threshold and settles at 200 MiB: alive and well if thawed.
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path), "--threshold", "50%",
                "--criu", str(_failing_criu(tmp_path)), "--on-failure", on_failure,
                "--actions", "checkpoint" if on_failure == "thaw" else "checkpoint,kill") as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(log, target=200, rate=200, count=100_000))
        try:
            failed = guard.wait_event("checkpoint.failed", timeout=30)[0]
            assert failed["outcome"] == "thawed"  # CRIU resumed it; the rule decides what next
            assert "simulated" in failed["error"] or "status 1" in failed["error"]
            if on_failure == "thaw":
                mark = last_count(log)
                assert wait_until(lambda: last_count(log) > mark + 10, 10), "not running"
                assert proc_state(hog.pid) not in ("T", "t")
                assert hog.poll() is None
            else:
                # on_failure = "kill": the chain is checkpoint, kill (SIGTERM, then SIGKILL)
                killed = guard.wait_event("victim.killed", timeout=30)[0]
                assert killed["pid"] == hog.pid and killed["reason"]
                assert hog.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
        finally:
            kill_pid(hog.pid)
            hog.wait()
    assert not Store(store).list(), "a failed checkpoint must not look like one"
    assert not Store(store).partials(), "partial checkpoint left behind"


def test_unwritable_store_leaves_the_process_running(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg = cgroups.make("nostore", None)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's parent should be")
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=100, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 5, 10)
        result = run_oomguard(blocker / "store", "checkpoint", str(hog.pid))
        assert result.returncode == 1
        assert '"outcome": "untouched"' in result.stderr and "not-a-dir" in result.stderr
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 10, 10), "victim left stopped"
        assert hog.poll() is None
    finally:
        kill_pid(hog.pid)
        hog.wait()


def test_restore_refuses_taken_pid_and_too_small_cgroup_then_works(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("pid", None)
    tiny = cgroups.make("tiny", 32 * MiB)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=96, rate=500, count=400))
    assert wait_until(lambda: last_count(log) > 30, 10)
    result = run_oomguard(store, "checkpoint", str(hog.pid))
    assert result.returncode == 0, result.stderr
    checkpoint_id = result.stdout.strip()
    # Not reaped yet: the zombie still holds the PID CRIU must restore.
    result = run_oomguard(store, "restore", checkpoint_id)
    assert result.returncode == 1
    assert f"{hog.pid} (python" in result.stderr and "in use" in result.stderr
    assert "oomguard exec" in result.stderr
    assert Store(store).get(checkpoint_id).state == "checkpointed"
    hog.wait()

    result = run_oomguard(store, "restore", checkpoint_id, "--cgroup", str(tiny.path))
    assert result.returncode == 1
    # It could never fit (a 32 MiB limit): said at once, with both figures, never waited for.
    assert "limited to 32 MiB" in result.stderr and "never fit" in result.stderr, \
        result.stderr
    assert tiny.snapshot().oom_kills == 0

    result = run_oomguard(store, "restore", checkpoint_id)
    assert result.returncode == 0, result.stderr
    try:
        assert wait_until(lambda: "done 400 ok" in log.read_text(), 30)
    finally:
        kill_pid(int(result.stdout.strip()))


def test_full_store_disk_thaws_the_victim(cgroups: CgroupFactory, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The dump runs out of space half way: another writer fills the store's disk (a 200 MiB
    tmpfs) as the dump of a ~96 MiB job starts, after the budget found room for it. The job
    is thawed and runs on, nothing is left in the store, and the error names the budget."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m,mode=700", "tmpfs",
                    str(mount_point)], check=True)
    cg = cgroups.make("full", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=96, rate=500, count=100_000))
    monkeypatch.setenv("OOMGUARD_CRIU", str(filling_criu(tmp_path, mount_point / "filler",
                                                         before=True)))
    try:
        assert wait_until(lambda: last_count(log) > 30, 10)
        unbudgeted = tmp_path / "unbudgeted.toml"  # only the room there is on the disk
        unbudgeted.write_text('[daemon]\nstore_max_size = "0"\nstore_keep_free = "0"\n')
        result = run_oomguard(mount_point / "store", "--config", str(unbudgeted), "checkpoint",
                              str(hog.pid))
        assert result.returncode == 1
        assert '"outcome": "thawed"' in result.stderr, result.stderr
        assert "the store's disk filled during the dump" in result.stderr, result.stderr
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 10, 10), "victim left stopped"
        assert hog.poll() is None
        store = Store(mount_point / "store")
        assert not store.list() and not store.partials()
    finally:
        kill_pid(hog.pid)
        hog.wait()
        subprocess.run(["umount", str(mount_point)], check=False)
