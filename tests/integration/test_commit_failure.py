"""The store's disk fills up between the dump and the commit: the process is gone (CRIU killed
it after writing its images), so the images are never deleted. The checkpoint is listed as
incomplete, and completed and restored once there is room: nothing is lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.act.criu import find_criu
from oomguard.store.checkpoints import Store
from oomguard.store.names import PARTIAL_PREFIX
from tests.helpers import (
    CgroupFactory,
    hog_argv,
    kill_pid,
    last_count,
    own_memory_cgroup,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


FILL = """import os, sys
fs = os.statvfs(os.path.dirname(sys.argv[1]))
free = fs.f_bavail * fs.f_frsize
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
os.posix_fallocate(fd, 0, free)
"""


def filling_criu(tmp_path: Path, filler: Path, *, before: bool = False) -> Path:
    """The real CRIU, behind a wrapper that fills the store's file system the moment a dump
    has succeeded (CRIU has killed the tree), before oomguard commits: the commit takes a few
    milliseconds now, too short a window to fill the disk from outside in time. `before`:
    filled as the dump starts instead (another writer takes the room the estimate saw)."""
    own = own_memory_cgroup()
    assert own is not None
    procs = own.path / "cgroup.procs"
    fill = tmp_path / "fill.py"
    fill.write_text(FILL)
    wrapper = tmp_path / "criu-then-fill"
    filling = (f'echo $$ > "{procs}"  # out of CRIU\'s small memory cgroup: tmpfs pages '
               f'are charged\n    "{sys.executable}" "{fill}" "{filler}"')
    wrapper.write_text(f"""#!/bin/sh
if [ "$1" = dump ] && [ {int(before)} = 1 ]; then
    {filling}
fi
"{find_criu()[0]}" "$@"
status=$?
if [ "$1" = dump ] && [ $status = 0 ] && [ {int(before)} = 0 ]; then
    {filling}
fi
exit $status
""")
    wrapper.chmod(0o700)
    return wrapper


def test_disk_full_at_commit_keeps_the_images_and_restores_later(
        cgroups: CgroupFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m,mode=700", "tmpfs",
                    str(mount_point)], check=True)
    store = mount_point / "store"
    filler = mount_point / "filler"
    cg = cgroups.make("commit", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=160, rate=500, count=400, tick=0.02))
    monkeypatch.setenv("OOMGUARD_CRIU", str(filling_criu(tmp_path, filler)))
    restored_pid = None
    try:
        assert wait_until(lambda: last_count(log) > 30, 20)
        # No budget: the disk fills between the dump and the commit, never before the dump.
        unbudgeted = tmp_path / "unbudgeted.toml"
        unbudgeted.write_text('[daemon]\nstore_max_size = "0"\nstore_keep_free = "0"\n')
        result = run_oomguard(store, "--config", str(unbudgeted), "checkpoint", str(hog.pid))
        assert filler.exists(), f"the disk was not filled (the dump may have failed): {result.stderr}"
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
        kill_pid(hog.pid)
        if restored_pid:
            kill_pid(restored_pid)
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
