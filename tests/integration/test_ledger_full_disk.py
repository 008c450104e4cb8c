"""The frozen ledger on a full disk (a real, small tmpfs): a write that would grow the file
fails with the ledger as it was, never half new (a half-written ledger loses every entry, and
the tasks it names would stay stopped after a crash)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.store.ledger import FrozenLedger


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=700", "tmpfs",
                    str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096) == 4096:
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_ledger_write_on_a_full_disk_fails_whole(small_disk: Path) -> None:
    path = small_disk / "store" / "frozen.json"
    ledger = FrozenLedger(path)
    kept = [f"/sys/fs/cgroup/memory/job-{i}" for i in range(3)]
    for directory in kept:
        ledger.record_cgroup(Path(directory))
    before = path.read_bytes()
    assert len(before) < 4096  # one page
    fill(small_disk / "filler")
    with pytest.raises(OSError) as failed:
        for i in range(20):  # long names: the ledger must grow past its first page
            ledger.record_cgroup(Path("/sys/fs/cgroup/memory/" + f"{i}-" + "x" * 400))
    assert failed.value.errno == errno.ENOSPC
    written = [e["cgroup"] for e in json.loads(path.read_bytes())]
    assert written[:3] == kept  # what was there before the failing write, whole
    assert [e.cgroup for e in ledger._load()] == written
    (small_disk / "filler").unlink()  # room again: the next write goes in
    ledger.record_cgroup(Path("/sys/fs/cgroup/memory/after"))
    assert [e.cgroup for e in ledger._load()][-1] == "/sys/fs/cgroup/memory/after"
