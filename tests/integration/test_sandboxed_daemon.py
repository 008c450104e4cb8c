"""The daemon in a mount namespace of its own (as the service unit's ProtectSystem= and
ProtectHome= give it: /usr read-only here), CRIU still in the host's (oomguard/act/hostns.py):
a guarded job is checkpointed, and restored by the daemon into the host's mount namespace, not
the daemon's read-only view, and goes on counting. The namespace is private to the daemon
(unshare); only its own /usr is remounted read-only, nothing of the host's. PID 1's namespace
is not readable here (criu.mount_namespace "auto"): the config names this test's, the host's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

SANDBOX = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
           'mount --bind /usr /usr && mount -o remount,bind,ro /usr && exec "$@"', "sandbox")


def mount_ns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


def test_criu_dumps_and_restores_in_the_hosts_namespace_from_a_sandboxed_daemon(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("sandboxed", 128 * MiB)
    big = cgroups.make("sandboxed-big", 1024 * MiB)
    config = tmp_path / "sandboxed.toml"
    config.write_text(f'[criu]\nmount_namespace = "/proc/{os.getpid()}/ns/mnt"\n\n'
                      f'[[guard]]\ncgroups = ["{cg.path}"]\n')
    guard = DaemonProcess(store, tmp_path / "daemon.log", "--config", str(config),
                          wrapper=SANDBOX)
    restored = 0
    try:
        guard.wait_event("guard.armed")
        host = mount_ns(os.getpid())
        assert mount_ns(guard.handle.pid) != host  # the daemon is sandboxed
        log = tmp_path / "hog.log"
        hog = start_in_cgroup(cg, hog_argv(log, target=200, rate=100, count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == hog.pid
        assert hog.wait(timeout=10) == -signal.SIGKILL  # dumped: CRIU ended it
        counted = last_count(log)
        back = run_oomguard(store, "--socket", str(guard.socket), "restore", done["id"],
                            "--cgroup", str(big.path))
        assert back.returncode == 0, back.stderr
        restored = int(back.stdout.strip())
        assert guard.wait_event("restore.done")[0]["id"] == done["id"]  # by the daemon
        # Restored by CRIU in the host's mount namespace: not in the daemon's read-only view.
        assert mount_ns(restored) == host != mount_ns(guard.handle.pid)
        assert wait_until(lambda: last_count(log) > counted + 5, 30), log.read_text()[-300:]
    finally:
        guard.stop()
        if restored:
            kill_pid(restored)
