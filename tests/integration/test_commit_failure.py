"""The store's disk fills up between the dump and the commit: the process is gone (CRIU killed
it after writing its images), so the images are never deleted. The checkpoint is listed as
incomplete, and completed and restored once there is room: nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from oomguard.store import DUMP_SUCCESS, PARTIAL_PREFIX, Store
from tests.helpers import (
    CgroupFactory,
    hog_argv,
    kill_pid,
    last_count,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def fill_when_dumped(store: Path, filler: Path, stop: threading.Event) -> None:
    """Fill the file system the moment CRIU reports its dump finished (before the commit)."""
    while not stop.is_set():
        for log in store.glob(f"{PARTIAL_PREFIX}*/images/dump.log"):
            try:
                if DUMP_SUCCESS in log.read_text(errors="replace"):
                    free = os.statvfs(store).f_bavail * os.statvfs(store).f_frsize
                    with open(filler, "wb") as handle:
                        os.posix_fallocate(handle.fileno(), 0, free)
                    return
            except OSError:
                continue
        stop.wait(0.0005)


def test_disk_full_at_commit_keeps_the_images_and_restores_later(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m,mode=700", "tmpfs",
                    str(mount_point)], check=True)
    store = mount_point / "store"
    filler = mount_point / "filler"
    cg = cgroups.make("commit", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=160, rate=500, count=400, tick=0.02))
    stop = threading.Event()
    watcher = threading.Thread(target=fill_when_dumped, args=(store, filler, stop), daemon=True)
    restored_pid = None
    try:
        assert wait_until(lambda: last_count(log) > 30, 20)
        watcher.start()
        result = run_oomguard(store, "checkpoint", str(hog.pid))
        stop.set()
        watcher.join(5)
        assert filler.exists(), "the disk was not filled in time (the dump may have failed)"
        assert result.returncode == 1, result.stderr
        assert "dumped, commit pending" in result.stderr and "incomplete" in result.stderr
        assert hog.wait(timeout=10) != 0  # CRIU killed it: the images are all that is left
        listed = run_oomguard(store, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        [entry] = json.loads(listed.stdout)
        assert entry["state"] == "incomplete"
        checkpoint_id = entry["id"]
        assert (store / f"{PARTIAL_PREFIX}{checkpoint_id}" / "images").is_dir()
        # Still no room: the restore says so and deletes nothing.
        refused = run_oomguard(store, "restore", checkpoint_id)
        assert refused.returncode == 1 and "cannot be completed yet" in refused.stderr
        assert (store / f"{PARTIAL_PREFIX}{checkpoint_id}" / "images").is_dir()
        # Room again: the restore completes the commit, then brings the process back.
        filler.unlink()
        mark = last_count(log)
        restored = run_oomguard(store, "restore", checkpoint_id)
        assert restored.returncode == 0, restored.stderr
        restored_pid = int(restored.stdout.strip())
        assert wait_until(lambda: "done 400 ok" in log.read_text(), 60)
        assert read_counts(log) == list(range(1, 401))
        assert mark >= 30
        assert Store(store).get(checkpoint_id).state == "restored"
    finally:
        stop.set()
        kill_pid(hog.pid)
        if restored_pid:
            kill_pid(restored_pid)
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
