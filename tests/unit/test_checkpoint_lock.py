"""A checkpoint directory's lock (oomguard.store.checkpoints.open_lock): an flock on a file in
it, not on the directory, because on NFS only a file's flock is the server's (seen by every
node), and removals that keep the lock file for last (NFS keeps a directory whose file is still
open). Real flock(2)s on a temporary directory; the NFS side runs in the v2 lane
(tests/integration/test_nfs_store.py, two superblocks of one export as two nodes)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from oomguard.model.errors import RestoreInProgress, StoreError
from oomguard.store.checkpoints import (
    IMAGES,
    META,
    PARTIAL_PREFIX,
    CheckpointMeta,
    Store,
    open_lock,
    remove_checkpoint_dir,
)
from oomguard.store.names import CHECKPOINT_LOCK
from tests.unit.test_store import make_meta


def held_elsewhere(directory: Path) -> int:
    """Another holder's lock: another open file description of the lock file, as another
    process (or, over NFS, another node) has."""
    fd = os.open(directory / CHECKPOINT_LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def committed(store: Store, checkpoint_id: str) -> CheckpointMeta:
    meta = make_meta(checkpoint_id)
    images, lock_fd = store.begin(meta)
    (images / "pages-1.img").write_bytes(b"p" * 4096)
    store.commit(meta)
    os.close(lock_fd)
    return meta


def test_a_dump_holds_a_lock_file_that_another_holder_sees(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    images, lock_fd = store.begin(make_meta("ck1"))
    partial = images.parent
    assert (partial / CHECKPOINT_LOCK).is_file()
    assert (partial / CHECKPOINT_LOCK).stat().st_mode & 0o777 == 0o600
    with pytest.raises(BlockingIOError):
        held_elsewhere(partial)
    assert store.recover_partials() == [("ck1", "in progress")]
    os.close(lock_fd)  # its CRIU is gone, its dump unfinished
    assert store.recover_partials() == [("ck1", "removed")]
    assert not partial.exists()


def test_a_partial_without_a_lock_file_from_an_older_version_is_settled(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.ensure()
    partial = store.root / f"{PARTIAL_PREFIX}ck2"
    (partial / IMAGES).mkdir(parents=True)
    (partial / META).write_text(make_meta("ck2").to_json())
    assert store.recover_partials() == [("ck2", "removed")]
    assert not partial.exists()


def test_a_restore_elsewhere_refuses_a_second_and_a_forget(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    committed(store, "ck3")
    other = held_elsewhere(store.path_of("ck3"))
    try:
        with pytest.raises(RestoreInProgress), store.restore_lock("ck3"):
            pass
        with pytest.raises(RestoreInProgress):
            store.forget("ck3")
        assert [m.id for m in store.list()] == ["ck3"]
    finally:
        os.close(other)
    with store.restore_lock("ck3") as fd:
        with pytest.raises(BlockingIOError):
            held_elsewhere(store.path_of("ck3"))
        assert fd >= 0
    store.forget("ck3")
    assert not store.path_of("ck3").exists() and store.list() == []


def test_the_lock_file_goes_last_and_the_lock_with_it(tmp_path: Path) -> None:
    directory = tmp_path / "ck4"
    (directory / IMAGES / "deep").mkdir(parents=True)
    (directory / IMAGES / "deep" / "x").write_bytes(b"x")
    (directory / META).write_text("{}")
    lock_fd = open_lock(directory)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    remove_checkpoint_dir(directory, lock_fd)
    assert not directory.exists()
    with pytest.raises(OSError):
        os.fstat(lock_fd)  # closed by the removal
    with pytest.raises(FileNotFoundError):
        remove_checkpoint_dir(directory)


def test_an_abort_closes_the_dumps_lock_and_leaves_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    images, lock_fd = store.begin(make_meta("ck5"))
    (images / "pages-1.img").write_bytes(b"p")
    store.abort("ck5", lock_fd)
    assert store.partials() == []
    with pytest.raises(OSError):
        os.fstat(lock_fd)


def test_a_symlinked_checkpoint_directory_is_never_followed(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.ensure()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store.root / "ck6").symlink_to(elsewhere)
    with pytest.raises(OSError):
        open_lock(store.root / "ck6")
    with pytest.raises(StoreError), store.restore_lock("ck6"):
        pass
    assert not (elsewhere / CHECKPOINT_LOCK).exists()
