"""When a page-out cannot work, the next step runs and the event says why (issue 29, item 4),
with the real daemon, the real CRIU and the real kernel: a job holding a Unix connection to a
server outside its tree (CRIU refuses it) grows past its cgroup's threshold under
actions = ["checkpoint", "pageout", "kill"], and the page-out is refused

- by a store on a file system that cannot hold a swap file (tmpfs: swapon refuses it),
- by the store's budget (a swap file the job's size would take the store over it),
- by the daemon's missing right (CAP_SYS_NICE dropped, as in a container without it).

Each time `pageout.failed` names the cause and `kill` as what comes next, the kill step ends the
job once with the reason, nothing is left stopped or recorded as paged out, no swap file of
oomguard's is left, on or off, and the kernel's OOM killer never ran."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.act.swapfiles import SwapFiles
from oomguard.store.names import PAGED_OUT, SWAP_DIR
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    close_server,
    kill_pid,
    outside_server,
    short_socket_path,
    start_in_cgroup,
)
from tests.integration.test_pageout_chain import chunks_job

pytestmark = pytest.mark.integration
LIMIT = 256 * MiB


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600m,mode=700", "tmpfs",
                    str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        for area in SwapFiles(mount_point / "store" / SWAP_DIR).ours():
            SwapFiles(mount_point / "store" / SWAP_DIR).remove(Path(area.path))
        subprocess.run(["umount", str(mount_point)], check=False)


def _refused_then_killed(cgroups: CgroupFactory, tmp_path: Path, store: Path, extra: str,
                         wrapper: tuple[str, ...] = ()) -> dict[str, object]:
    """Runs the scenario; returns the pageout.failed event."""
    cg = cgroups.make("refused", LIMIT)
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    socket = short_socket_path()
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{socket}"\n{extra}\n'
                      f'[[guard]]\ncgroups = ["{cg.path}"]\n'
                      'actions = ["checkpoint", "pageout", "kill"]\nkill_grace = "1s"\n')
    guard = DaemonProcess(store, tmp_path / "daemon.log", config=config, socket=socket,
                          wrapper=wrapper)
    job = None
    try:
        guard.wait_event("guard.ready")
        job = start_in_cgroup(cg, chunks_job(tmp_path / "job.log", 232, 100000, peer))
        failed = guard.wait_event("pageout.failed", timeout=60)[0]
        assert failed["pid"] == job.pid and failed["then"] == "kill", failed
        killed = guard.wait_event("victim.killed", timeout=60)[0]
        assert killed["pid"] == job.pid, killed
        assert job.wait(timeout=20) in (-signal.SIGTERM, -signal.SIGKILL)
        assert len(guard.events("pageout.failed")) == 1  # once: no loop
        assert not guard.events("victim.paged_out")
        assert not (store / PAGED_OUT).exists()
        assert SwapFiles(store / SWAP_DIR).ours() == []
        assert SwapFiles(store / SWAP_DIR).leftovers() == []
        assert cg.snapshot().oom_kills == 0
        return failed
    finally:
        guard.stop()
        if job is not None:
            kill_pid(job.pid)
        close_server(server, accepted)


def test_a_store_that_cannot_hold_a_swap_file_lets_the_kill_step_run(
        cgroups: CgroupFactory, tmp_path: Path, tmpfs: Path) -> None:
    failed = _refused_then_killed(cgroups, tmp_path, tmpfs / "store",
                                  'store_max_size = "90%"\nstore_keep_free = "1%"\n')
    assert "swapon" in str(failed["reason"]), failed


def test_a_swap_file_over_the_store_budget_lets_the_kill_step_run(
        cgroups: CgroupFactory, tmp_path: Path, tmpfs: Path) -> None:
    failed = _refused_then_killed(cgroups, tmp_path, tmpfs / "store",
                                  'store_max_size = "64M"\n')
    assert "within the store's budget" in str(failed["reason"]), failed


def test_a_daemon_without_cap_sys_nice_lets_the_kill_step_run(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    drop = ("setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", "--")
    failed = _refused_then_killed(cgroups, tmp_path, tmp_path / "store", "", wrapper=drop)
    assert "no right to page out" in str(failed["reason"]), failed
