"""oomguard.act.podmanpartials: a .partial container archive a dead daemon left, settled by the
next one: real files and real processes; podman's answers from a recording runner (podman
cannot run containers on this v1 host: the engine lane checkpoints real ones)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zstandard

from oomguard.act.podman import PodmanEngine
from oomguard.act.podmanpartials import BUSY, KEPT, LEFT, REMOVED, partials_in, settle_partial
from oomguard.sense.procfs import ProcReader

CID = "0123456789ab"
WHOLE = zstandard.ZstdCompressor(write_checksum=True).compress(os.urandom(200_000))


def podman_saying(stdout: str, returncode: int = 0) -> PodmanEngine:
    def run(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        assert argv[1:4] == ["container", "inspect", "--format"] and argv[-1] == CID, argv
        return subprocess.CompletedProcess(argv, returncode, stdout,
                                           "" if returncode == 0 else "Error: no such container")
    return PodmanEngine(("podman",), run=run)


def partial(tmp_path: Path, blob: bytes) -> Path:
    path = tmp_path / "containers" / f"{CID}-20261207T120000.tar.zst.partial"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(blob)
    path.chmod(0o644)  # as podman may leave it
    return path


def nobody(_path: Path) -> list[int]:
    return []


def test_a_whole_archive_podman_checkpointed_is_kept_under_its_name(tmp_path: Path) -> None:
    path = partial(tmp_path, WHOLE)
    found = settle_partial(path, podman_saying("exited true\n"), using=nobody)
    assert found.outcome == KEPT and found.container == CID, found
    assert found.archive == path.with_name(f"{CID}-20261207T120000.tar.zst")
    assert not path.exists() and found.archive.read_bytes() == WHOLE
    assert stat.S_IMODE(found.archive.stat().st_mode) == 0o600


def test_a_whole_archive_of_a_container_podman_no_longer_knows_is_kept(tmp_path: Path) -> None:
    found = settle_partial(partial(tmp_path, WHOLE), podman_saying("", 125), using=nobody)
    assert found.outcome == KEPT and "no such container" in found.why, found
    found = settle_partial(partial(tmp_path, WHOLE), None, using=nobody)  # no podman here
    assert found.outcome == LEFT and "exists already" in found.why, found


def test_a_torn_archive_of_a_container_that_runs_on_is_removed(tmp_path: Path) -> None:
    path = partial(tmp_path, WHOLE[:len(WHOLE) // 2])
    found = settle_partial(path, podman_saying("running false\n"), using=nobody)
    assert found.outcome == REMOVED and "running" in found.why, found
    assert not path.exists() and partials_in(path.parent) == []


@pytest.mark.parametrize(("blob", "says", "code"), [
    (WHOLE[:100], "exited true\n", 0),  # torn, yet podman says checkpointed
    (WHOLE, "running false\n", 0),  # whole, yet the container runs
    (WHOLE[:100], "", 125),  # torn, and podman cannot say
])
def test_what_could_be_the_only_copy_is_left_and_said(tmp_path: Path, blob: bytes, says: str,
                                                       code: int) -> None:
    path = partial(tmp_path, blob)
    found = settle_partial(path, podman_saying(says, code), using=nobody)
    assert found.outcome == LEFT and found.why, found
    assert path.read_bytes() == blob


def test_one_still_written_is_left_for_later(tmp_path: Path) -> None:
    """Named on a running command line (podman dumps before it writes there), or held open."""
    path = partial(tmp_path, WHOLE[:10])
    named = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)",
                              str(path)])
    holder = subprocess.Popen([sys.executable, "-c",  # the path only in its environment
                               "import os, time; f = open(os.environ['ARCHIVE'], 'ab'); "
                               "print('open', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, env={**os.environ, "ARCHIVE": str(path)})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"open\n"
        users = ProcReader().using(path)
        assert named.pid in users and holder.pid in users, users
        found = settle_partial(path, podman_saying("running false\n"))
        assert found.outcome == BUSY and str(named.pid) in found.why, found
        assert path.exists()
    finally:
        for child in (named, holder):
            child.kill()
            child.wait()
    assert ProcReader().using(path) == []
    assert settle_partial(path, podman_saying("running false\n")).outcome == REMOVED
