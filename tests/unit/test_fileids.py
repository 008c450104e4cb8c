"""File identities recorded at dump time and checked before a restore."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.lifecycle import fileids
from oomguard.lifecycle.restore import Restorer
from oomguard.model.errors import RestoreFailed
from oomguard.store.checkpoints import Store
from tests.unit.test_store import checkpoint, make_meta


def test_record_sees_open_files_cwd_and_mappings(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("x" * 100)
    child = subprocess.Popen([sys.executable, "-c", "import sys,time; f=open(sys.argv[1]); "
                              "print('ok', flush=True); time.sleep(30)", str(data)],
                             cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        files = {f.path: f for f in fileids.record([child.pid])}
    finally:
        child.kill()
        child.wait()
    assert files[str(data)].ino == data.stat().st_ino
    assert str(tmp_path) in files  # the working directory
    assert any(path.endswith(".so") or ".so." in path for path in files)  # mapped libraries
    assert fileids.from_json(fileids.to_json(list(files.values()))) == sorted(
        files.values(), key=lambda f: f.path)


def test_changed_sees_a_symlink_swap_and_a_replaced_file(tmp_path: Path) -> None:
    log, secret = tmp_path / "job.log", tmp_path / "secret"
    log.write_text("a" * 10)
    secret.write_text("b" * 10)
    recorded = [fileids.FileIdentity(str(log), *_ids(log))]
    assert fileids.changed(recorded) == []
    os.rename(log, tmp_path / "job.log.orig")
    log.symlink_to(secret)
    [problem] = fileids.changed(recorded)
    assert str(log) in problem and "symlink" in problem
    log.unlink()
    assert fileids.changed(recorded) == []  # gone: CRIU's restore says so itself
    # Re-created by its owner (a rotated log, a requeued job's new output file): no problem.
    log.write_text("c" * 3)
    assert fileids.changed(recorded) == []
    # ...but one of another owner is.
    other = [fileids.FileIdentity(str(log), *_ids(log)[:2], 1000, _ids(log)[3])]
    [problem] = fileids.changed(other)
    assert "owner uid 1000 -> 0" in problem


def _ids(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_uid, st.st_mode & 0o170000


@pytest.mark.parametrize(("uid", "force", "refused"), [
    (1000, False, True), (1000, True, True), (0, False, True), (0, True, False)],
    ids=["user", "user-force", "root", "root-force"])
def test_restore_refuses_a_swapped_file(tmp_path: Path, uid: int, force: bool,
                                        refused: bool) -> None:
    store = Store(tmp_path / "store")
    meta = make_meta("ck1", uid=uid)
    checkpoint(store, meta)
    log, secret = tmp_path / "job.log", tmp_path / "secret"
    log.write_text("a" * 10)
    secret.write_text("b" * 10)
    store.write_private(store.path_of("ck1") / fileids.FILES_RECORD,
                        fileids.to_json([fileids.FileIdentity(str(log), *_ids(log))]))
    log.unlink()
    log.symlink_to(secret)
    restorer: Any = Restorer.__new__(Restorer)
    restorer.store = store
    if refused:
        with pytest.raises(RestoreFailed, match="would get a file its owner did not have"):
            restorer._check_files(store.get("ck1"), force)
    else:
        restorer._check_files(store.get("ck1"), force)
