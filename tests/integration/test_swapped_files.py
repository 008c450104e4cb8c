"""A path the checkpointed process had open is swapped for a symlink to another file of the
same size before the restore: CRIU (as root) would open that file for the process. The restore
is refused naming the file, deletes nothing, and works again once the file is put back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.store.checkpoints import Store
from tests.helpers import (
    CgroupFactory,
    hog_argv,
    kill_pid,
    last_count,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_restore_refuses_a_file_swapped_for_a_symlink(cgroups: CgroupFactory, store: Path,
                                                      tmp_path: Path) -> None:
    cg = cgroups.make("swap", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=200, count=300, tick=0.02))
    restored = None
    try:
        assert wait_until(lambda: last_count(log) > 20, 10)
        result = run_oomguard(store, "checkpoint", str(hog.pid))
        assert result.returncode == 0, result.stderr
        checkpoint_id = result.stdout.strip()
        hog.wait(timeout=10)
        # The swap: same size, another file (root-only in the attack), through a symlink.
        secret = tmp_path / "secret"
        secret.write_bytes(b"s" * log.stat().st_size)
        secret.chmod(0o600)
        os.rename(log, tmp_path / "hog.log.orig")
        log.symlink_to(secret)
        refused = run_oomguard(store, "restore", checkpoint_id)
        assert refused.returncode == 1
        assert f"{log} is another file than the one the process had open" in refused.stderr
        assert "(it is now a symlink)" in refused.stderr
        assert Store(store).get(checkpoint_id).state == "checkpointed"
        assert secret.read_bytes() == b"s" * secret.stat().st_size
        # Put back: the same checkpoint restores and the job goes on where it was.
        log.unlink()
        os.rename(tmp_path / "hog.log.orig", log)
        again = run_oomguard(store, "restore", checkpoint_id)
        assert again.returncode == 0, again.stderr
        restored = int(again.stdout.strip())
        assert wait_until(lambda: "done 300 ok" in log.read_text(), 60)
        assert read_counts(log) == list(range(1, 301))
    finally:
        kill_pid(hog.pid)
        if restored:
            kill_pid(restored)


def _cap_sys_resource() -> bool:
    from oomguard.sense.psi import has_cap_sys_resource

    return has_cap_sys_resource(Path("/proc/self/status").read_text())


@pytest.mark.skipif(not _cap_sys_resource(),
                    reason="root here lacks CAP_SYS_RESOURCE, so CRIU cannot dump another "
                           "user's process; this test runs in the v2 VM lane, where root has it")
def test_a_users_checkpoint_is_never_restored_onto_a_swapped_file(
        cgroups: CgroupFactory, store: Path, request: pytest.FixtureRequest) -> None:
    """The attack for real: the job's owner swaps its log for a symlink to a root-only file of
    the same size; not even root's --force restores the user's job onto it."""
    import shutil
    import tempfile

    uid = unprivileged_user("oomguard-t-swapper", 40041)
    workdir = Path(tempfile.mkdtemp(prefix="og-swap-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    os.chown(workdir, uid, uid)
    cg = cgroups.make("userswap", None)
    log = workdir / "hog.log"
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    # 60 s of life: the emulated lane's CLI is slow to start (see test_guard's tree test);
    # with 20 s the count once ended during the dump ("Unable to detach ... No such process")
    hog = start_in_cgroup(cg, [*as_user, *hog_argv(log, target=16, rate=200, count=3000,
                                                    tick=0.02)], cwd=workdir)
    restored = None
    try:
        assert wait_until(lambda: last_count(log) > 20, 20)
        result = run_oomguard(store, "checkpoint", str(hog.pid))
        assert result.returncode == 0, result.stderr
        checkpoint_id = result.stdout.strip()
        hog.wait(timeout=10)
        secret = Path(tempfile.mkdtemp(prefix="og-secret-", dir="/tmp")) / "secret"
        request.addfinalizer(lambda: shutil.rmtree(secret.parent, ignore_errors=True))
        secret.write_bytes(b"s" * log.stat().st_size)
        secret.chmod(0o600)
        swap = ("import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.orig'); "
                "os.symlink(sys.argv[2], sys.argv[1])")
        subprocess.run([*as_user, sys.executable, "-c", swap, str(log), str(secret)],
                       check=True, timeout=30)
        for extra in ((), ("--force",)):
            refused = run_oomguard(store, "restore", checkpoint_id, *extra)
            assert refused.returncode == 1
            assert f"{log} is another file than the one the process had open" in refused.stderr
        log.unlink()
        os.rename(workdir / "hog.log.orig", log)
        again = run_oomguard(store, "restore", checkpoint_id)
        assert again.returncode == 0, again.stderr
        restored = int(again.stdout.strip())
        assert wait_until(lambda: "done 3000 ok" in log.read_text(), 180)
    finally:
        kill_pid(hog.pid)
        if restored:
            kill_pid(restored)
