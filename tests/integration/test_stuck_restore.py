"""A checkpoint that can never restore is not retried forever (issue 26, item 9): the file a
job had open changed size after its checkpoint, so every restore fails (CRIU's size check).
The daemon's auto-restore tries it restore_attempts times, restore_retry apart, then marks it
`stuck` with the reason (list, show) and tries no more; a person's restore still may."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.store.checkpoints import open_lock
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    daemon,
    last_count,
    start_in_cgroup,
    wait_until,
)
from tests.integration.test_store_budget import cli

pytestmark = pytest.mark.integration

MiB = 1 << 20
RETRY = 2.0
ATTEMPTS = 3

COUNTING_JOB = """
import sys, time
log = open(sys.argv[1], "w", buffering=1)
count = 0
while True:
    count += 1
    log.write(f"{count}\\n")
    time.sleep(0.05)
"""


def auto_restore_config(tmp_path: Path, cgroup: MemoryCgroup, name: str) -> Path:
    """A rule on `cgroup` that restores its checkpoints itself, RETRY apart, ATTEMPTS times."""
    config = tmp_path / f"{name}.toml"
    config.write_text(f'[daemon]\nrescan_interval = "500ms"\n\n[[guard]]\n'
                      f'cgroups = ["{cgroup.path}"]\nauto_restore = true\nrestore_quiet = "1s"\n'
                      f'restore_retry = "{RETRY:g}s"\nrestore_attempts = {ATTEMPTS}\n')
    return config


def started_and_checkpointed(guard: DaemonProcess, cgroup: MemoryCgroup, log: Path
                             ) -> tuple[subprocess.Popen[bytes], str]:
    """The counting job started in `cgroup` and, once it counts, checkpointed on request: the
    job (not yet waited for) and its checkpoint's id."""
    guard.wait_event("guard.armed")
    assert wait_until(guard.socket.exists, 10)
    job = start_in_cgroup(cgroup, [sys.executable, "-c", COUNTING_JOB, str(log)])
    assert wait_until(lambda: last_count(log) > 5, 20)
    done = cli(guard.socket, "checkpoint", str(job.pid))
    assert done.returncode == 0, done.stderr
    return job, done.stdout.strip()


def test_an_auto_restore_that_always_fails_ends_stuck(cgroups: CgroupFactory, store: Path,
                                                       tmp_path: Path) -> None:
    cg = cgroups.make("stuck", 512 * MiB)
    log = tmp_path / "job.log"
    with daemon(store, tmp_path / "daemon.log", "--config",
                str(auto_restore_config(tmp_path, cg, "stuck"))) as guard:
        job, checkpoint_id = started_and_checkpointed(guard, cg, log)
        assert job.wait(timeout=10) == -signal.SIGKILL
        with log.open("a") as grown:  # the file it had open is no longer the size it had
            grown.write("written after the checkpoint\n")
        [stuck] = guard.wait_event("restore.stuck", timeout=60 + ATTEMPTS * RETRY)
        assert stuck["id"] == checkpoint_id and stuck["attempts"] == ATTEMPTS
        assert "size" in stuck["reason"], stuck
        failed = guard.events("restore.failed")
        assert [e["id"] for e in failed] == [checkpoint_id] * ATTEMPTS
        assert [e["retry_in_s"] for e in failed] == [RETRY] * (ATTEMPTS - 1) + [None]
        # No further attempt: counted from the events over five retry periods.
        assert not wait_until(lambda: len(guard.events("restore.auto")) > ATTEMPTS,
                              5 * RETRY + 1)
        assert len(guard.events("restore.failed")) == ATTEMPTS
        listed = cli(guard.socket, "list")
        assert listed.returncode == 0, listed.stderr
        [row] = [line for line in listed.stdout.splitlines() if checkpoint_id in line]
        assert " stuck " in row, listed.stdout
        [entry] = json.loads(cli(guard.socket, "list", "--json").stdout)
        assert entry["stuck"] == stuck["reason"] and entry["restore_failures"] == ATTEMPTS
        assert entry["state"] == "checkpointed"  # a person's restore may still try
        shown = cli(guard.socket, "show", checkpoint_id)
        assert shown.returncode == 0, shown.stderr
        assert "stuck" in shown.stdout and "no longer tried automatically" in shown.stdout
        tried = cli(guard.socket, "restore", checkpoint_id)
        assert tried.returncode == 1 and "size" in tried.stderr, tried.stderr
        assert len(guard.events("restore.failed")) == ATTEMPTS + 1
        assert guard.events("restore.failed")[-1]["auto"] is False


def test_auto_restores_that_lose_the_race_to_another_restore_never_make_it_stuck(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Another restorer (here: the test, holding the checkpoint's restore lock as a person's
    `oomguard restore` or a lazy restore's keeper does) has the checkpoint for longer than
    restore_attempts retries: each auto-restore says restore.raced, none counts as a failure,
    and once the lock is let go the daemon restores it."""
    import fcntl
    import os

    cg = cgroups.make("raced", 512 * MiB)
    log = tmp_path / "job.log"
    with daemon(store, tmp_path / "daemon.log", "--config",
                str(auto_restore_config(tmp_path, cg, "raced"))) as guard:
        # The lock is taken before the checkpoint exists as such: its lock file, once there.
        job, checkpoint_id = started_and_checkpointed(guard, cg, log)
        held = open_lock(store / checkpoint_id)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert job.wait(timeout=10) == -signal.SIGKILL
            guard.wait_event("restore.raced", count=ATTEMPTS + 1, timeout=60 + 3 * ATTEMPTS * RETRY)
        finally:
            os.close(held)
        assert not guard.events("restore.failed") and not guard.events("restore.stuck")
        [entry] = json.loads(cli(guard.socket, "list", "--json").stdout)
        assert entry["restore_failures"] == 0 and not entry.get("stuck"), entry
        [restored] = guard.wait_event("restore.done", timeout=60)
        assert restored["id"] == checkpoint_id
        restored_pid = int(restored["pid"])
        try:
            before = last_count(log)
            assert wait_until(lambda: last_count(log) > before + 5, 20)
        finally:
            os.kill(restored_pid, signal.SIGKILL)
