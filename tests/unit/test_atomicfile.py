"""oomguard.model.atomicfile: the one way a small file is written whole (issue 30 item 5)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from oomguard.model import atomicfile
from oomguard.model.atomicfile import temporary_name, write_atomically


def test_it_writes_the_content_with_exactly_the_mode_whatever_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "ledger.json"
    old = os.umask(0o077)
    try:
        write_atomically(target, "{}", 0o644)
        write_atomically(tmp_path / "hook", b"#!/bin/sh\n", 0o700)
    finally:
        os.umask(old)
    assert target.read_text() == "{}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "hook").stat().st_mode) == 0o700
    write_atomically(target, "[]")  # the default: private
    assert target.read_text() == "[]" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "ledger.json"]


@pytest.mark.parametrize("sync", [True, False])
def test_the_fsyncs_are_the_file_and_its_directory_or_none(tmp_path: Path, sync: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bool] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(atomicfile.os, "fsync", fsync)
    write_atomically(tmp_path / "f", "x", sync=sync)
    assert synced == ([False, True] if sync else [])


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "meta.json"
    write_atomically(target, "old")

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicfile.os, "write", full)
    with pytest.raises(OSError):
        write_atomically(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_a_failed_rename_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "record").mkdir()  # a rename never replaces a directory
    with pytest.raises(OSError):
        write_atomically(tmp_path / "record", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["record"]


def test_a_symlink_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    planted = temporary_name(tmp_path / "f")
    planted.symlink_to(victim)  # at the temporary name: removed, not followed
    (tmp_path / "f").symlink_to(victim)  # at the target: replaced, not followed
    write_atomically(tmp_path / "f", "mine")
    assert victim.read_text() == "untouched"
    assert not (tmp_path / "f").is_symlink() and (tmp_path / "f").read_text() == "mine"
    assert not planted.exists() and not planted.is_symlink()
