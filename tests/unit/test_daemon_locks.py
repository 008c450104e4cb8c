"""The daemon's locks (oomguard.daemon.locks) with real flock(2)s on files in a temporary
directory: held against a second taker (named by PID), let go with their holder, and a
reload's set taken whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.daemon.locks import DaemonLocks, LockHeld, take_lock


def test_a_held_lock_names_its_holder_and_goes_with_it(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [sys.executable, "-I", "-c", "import sys; from oomguard.daemon.locks import take_lock; "
         f"take_lock(__import__('pathlib').Path({str(path)!r}), 'x'); print('held', "
         "flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(LockHeld, match=f"pid {holder.pid}") as refused:
            take_lock(path, "x")
        assert refused.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    take_lock(path, "x").release()  # its death let it go
    assert not path.exists()


def test_a_reload_takes_its_cgroups_whole_or_not_at_all(tmp_path: Path) -> None:
    mine, other = DaemonLocks(lock_dir=tmp_path), DaemonLocks(lock_dir=tmp_path)
    mine.take_cgroups({"/a": "cgroup /a", "/b": "cgroup /b"})
    other.take_cgroups({"/c": "cgroup /c"})
    with pytest.raises(LockHeld, match="cgroup /c"):
        mine.take_cgroups({"/a": "cgroup /a", "/d": "cgroup /d", "/c": "cgroup /c"})
    assert sorted(mine.cgroups) == ["/a", "/b"]  # unchanged, and /d not left held
    other.take_cgroups({"/d": "cgroup /d"})  # /d free; /c let go
    mine.take_cgroups({"/a": "cgroup /a", "/c": "cgroup /c"})  # /b let go
    assert sorted(mine.cgroups) == ["/a", "/c"]
    other.take_cgroups({"/b": "cgroup /b", "/d": "cgroup /d"})
    mine.release()
    other.release()
    assert list(tmp_path.iterdir()) == []
