"""This node's records apart from the store (oomguard.store.nodestate), on this host's disk:
with `[daemon] state_dir` set, a real daemon keeps its lock, its ledgers and CRIU's action
script there, and the store holds its checkpoints alone; a second daemon on the same store is
refused even with a state directory of its own (one daemon per store on a node). The store
shared between nodes for real (NFS) is tests/integration/test_nfs_store.py, in the v2 lane."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from oomguard.store.names import FROZEN_LEDGER, HOOKS_DIR, STORE_LOCK
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    kill_pid,
    short_socket_path,
    start_in_cgroup,
)

pytestmark = pytest.mark.integration


def config_file(tmp_path: Path, name: str, store: Path, state: Path, cgroup: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[daemon]\nstore = "{store}"\nstate_dir = "{state}"\n'
                    f'socket = "{short_socket_path()}"\n\n[[guard]]\ncgroups = ["{cgroup}"]\n')
    return path


def test_a_configured_state_dir_holds_the_nodes_records_and_the_store_its_checkpoints(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("nodestate", 128 * MiB)
    state = tmp_path / "node"
    guard = DaemonProcess(store, tmp_path / "daemon.log",
                          config=config_file(tmp_path, "a", store, state, str(cg.path)))
    second = None
    job = start_in_cgroup(cg, hog_argv(tmp_path / "job.log", target=160, rate=100, count=600),
                          cwd=tmp_path)
    try:
        [started] = guard.wait_event("guard.started")
        assert started["node_state"] == str(state)
        assert (state / STORE_LOCK).exists() and not (store / STORE_LOCK).exists()
        other = cgroups.make("nodestate2", 128 * MiB)
        second = DaemonProcess(store, tmp_path / "second.log",
                               config=config_file(tmp_path, "b", store, tmp_path / "node2",
                                                  str(other.path)))
        assert second.handle.wait(timeout=30) != 0
        refusal = (tmp_path / "second.log").read_text()
        assert f"pid {guard.handle.pid}" in refusal and "on this node" in refusal, refusal
        [done] = guard.wait_event("checkpoint.done", timeout=60)
        assert job.wait(timeout=30) == -signal.SIGKILL
        assert (state / HOOKS_DIR).is_dir() and (state / FROZEN_LEDGER).exists()
        assert sorted(p.name for p in store.iterdir()) == [done["id"]]
        assert state.stat().st_mode & 0o777 == 0o700
    finally:
        guard.stop()
        if second is not None:
            second.stop()
        kill_pid(job.pid)
