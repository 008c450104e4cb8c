"""A store shared between nodes (issue 28, item 3): each node keeps its own records apart
from it (oomguard.store.nodestate), takes its own lock (one daemon per store per node), and
every ledger, CRIU's action script and the swap files follow the node's state directory.
The mount table is a file written here; the locks are real flock(2)s; the checkpointer and
the control service are the daemon's own, built from a config."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import pytest

from oomguard.act.criu import Criu
from oomguard.config.loading import load_config_text
from oomguard.control.realparts import build_checkpointer, open_store
from oomguard.daemon.locks import DaemonLocks, LockHeld
from oomguard.model.errors import ConfigError
from oomguard.store.names import FROZEN_LEDGER, LIFTS_LEDGER, OOM_SHIELD, STORE_LOCK
from oomguard.store.nodestate import NodeState, mount_type, node_state

MOUNTS = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:21 / /run rw,nosuid shared:5 - tmpfs tmpfs rw
31 22 0:40 / /shared rw,relatime shared:9 - nfs4 nodea:/srv/shared rw,vers=4.2
32 31 0:41 / /shared/local rw,relatime shared:10 - ext4 /dev/vdb rw
33 22 0:42 / /mnt/with\\040space rw - cifs //srv/x rw
"""


@pytest.fixture
def mountinfo(tmp_path: Path) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTS)
    return path


def test_the_file_system_of_a_path_is_its_longest_mount_point(mountinfo: Path) -> None:
    assert mount_type(Path("/shared/oomguard"), mountinfo) == "nfs4"
    assert mount_type(Path("/shared"), mountinfo) == "nfs4"
    assert mount_type(Path("/shared/local/store"), mountinfo) == "ext4"  # mounted inside it
    assert mount_type(Path("/sharedx/store"), mountinfo) == "ext4"  # not under /shared
    assert mount_type(Path("/mnt/with space/s"), mountinfo) == "cifs"  # mountinfo's \040
    assert mount_type(Path("/var/lib/oomguard"), mountinfo) == "ext4"
    assert mount_type(Path("/x"), Path("/nonexistent/mountinfo")) == ""


def test_a_store_of_its_own_keeps_the_nodes_records(mountinfo: Path) -> None:
    state = node_state(Path("/var/lib/oomguard"), mountinfo=mountinfo)
    assert state == NodeState(Path("/var/lib/oomguard"), "ext4", False,
                              "in the store (a file system of this node's)")


def test_a_shared_store_sends_the_nodes_records_to_run(mountinfo: Path) -> None:
    state = node_state(Path("/shared/oomguard"), mountinfo=mountinfo, root=Path("/run/og"))
    digest = hashlib.sha256(b"/shared/oomguard").hexdigest()[:16]
    assert state.path == Path("/run/og") / digest and state.shared and state.fs_type == "nfs4"
    assert "nfs4" in state.why
    # Configured: where the admin says, shared or not.
    chosen = node_state(Path("/shared/oomguard"), Path("/var/lib/og-node"), mountinfo=mountinfo)
    assert chosen.path == Path("/var/lib/og-node") and chosen.shared


def test_state_dir_must_be_an_absolute_path() -> None:
    config = load_config_text('[daemon]\nstate_dir = "/var/lib/og-node"\n', "t.toml")
    assert config.state_dir == Path("/var/lib/og-node")
    assert config.node_state_dir == Path("/var/lib/og-node")
    assert load_config_text("", "t.toml").node_state_dir == load_config_text("", "t").store
    with pytest.raises(ConfigError, match=r"daemon\.state_dir") as bad:
        load_config_text('[daemon]\nstate_dir = "node"\n', "t.toml")
    assert "t.toml" in str(bad.value) and "absolute" in str(bad.value)


def test_two_nodes_run_a_daemon_each_on_one_store_but_one_node_runs_one(tmp_path: Path) -> None:
    """Node A and node B: each its own /run (lock_dir) and state directory; the store is one
    directory. On one node a second daemon is refused, even with another state directory."""
    store = tmp_path / "shared"
    node_a, node_b = DaemonLocks(lock_dir=tmp_path / "a-run"), DaemonLocks(lock_dir=tmp_path / "b-run")
    node_a.take_store(store, tmp_path / "a-state")
    node_b.take_store(store, tmp_path / "b-state")  # the other node: not refused
    assert (tmp_path / "a-state" / STORE_LOCK).exists() and not (store / STORE_LOCK).exists()
    second = DaemonLocks(lock_dir=tmp_path / "a-run")
    with pytest.raises(LockHeld, match="on this node"):
        second.take_store(store, tmp_path / "a-state-2")
    with pytest.raises(LockHeld, match="a-state"):
        DaemonLocks(lock_dir=tmp_path / "c-run").take_store(tmp_path / "other", tmp_path / "a-state")
    second.release()
    node_a.release()
    node_b.release()
    assert os.listdir(tmp_path / "a-run") == []
    # A store of its own: one lock, in the store, as before.
    alone = DaemonLocks(lock_dir=tmp_path / "a-run")
    alone.take_store(store, store)
    assert (store / STORE_LOCK).exists() and alone.node_store is None
    alone.release()


def test_the_ledgers_and_the_action_script_follow_the_state_directory(tmp_path: Path) -> None:
    config = replace(load_config_text(f'[daemon]\nstore = "{tmp_path / "shared"}"\n', "t"),
                     state_dir=tmp_path / "node")
    checkpointer = build_checkpointer(config, Criu(binary="criu", version=(4, 2)))
    assert checkpointer.store.root == tmp_path / "shared"
    assert checkpointer.ledger.path == tmp_path / "node" / FROZEN_LEDGER
    assert checkpointer.lifts.ledger == tmp_path / "node" / LIFTS_LEDGER
    assert checkpointer.shield.path == tmp_path / "node" / OOM_SHIELD
    store = open_store(config)
    store.ensure()
    assert (tmp_path / "node").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o700
