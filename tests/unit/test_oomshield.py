"""oomguard.act.oomshield: -1000 while a v2 victim is being stopped, originals put back (by the
writer, or at the next start when the writer died), reused PIDs never touched. Fake /proc."""

from __future__ import annotations

from pathlib import Path

from oomguard.act.oomshield import OomShield
from oomguard.sense.procfs import ProcReader
from oomguard.store.names import OOM_SHIELD
from tests.unit._support import FakeProc, fake_proc_tree

OWNER = 50


def _proc(tmp_path: Path) -> Path:
    root = fake_proc_tree(tmp_path / "proc", [
        FakeProc(OWNER, 1, comm="oomguard", starttime=10),
        FakeProc(100, 1, starttime=500), FakeProc(101, 100, starttime=501),
        FakeProc(102, 100, starttime=502)])
    for pid, adj in ((100, 0), (101, 300), (102, -1000)):
        (root / str(pid) / "oom_score_adj").write_text(f"{adj}\n")
    return root


def _adj(root: Path, pid: int) -> int:
    return int((root / str(pid) / "oom_score_adj").read_text())


def _shield(tmp_path: Path, root: Path, owner: int = OWNER) -> OomShield:
    return OomShield(tmp_path / "store" / OOM_SHIELD, ProcReader(root), owner=owner)


def test_shield_and_put_back(tmp_path: Path) -> None:
    root = _proc(tmp_path)
    (tmp_path / "store").mkdir()
    shield = _shield(tmp_path, root)
    assert shield.shield([100, 101, 102, 999]) == [100, 101]  # 102 opted out already, 999 gone
    assert [_adj(root, p) for p in (100, 101, 102)] == [-1000, -1000, -1000]
    assert shield.original_of(101) == 300
    shield.unshield([100, 101, 102])
    assert [_adj(root, p) for p in (100, 101, 102)] == [0, 300, -1000]
    assert not (tmp_path / "store" / OOM_SHIELD).exists()


def test_a_child_forked_while_shielded_gets_the_parents_original(tmp_path: Path) -> None:
    root = _proc(tmp_path)
    (tmp_path / "store").mkdir()
    shield = _shield(tmp_path, root)
    shield.shield([100])
    shield.shield([100, 102], inherited=shield.original_of(100))  # 102 inherited -1000
    shield.unshield([100, 102])
    assert _adj(root, 100) == 0 and _adj(root, 102) == 0


def test_a_dead_writers_shield_is_put_back_at_start(tmp_path: Path) -> None:
    root = _proc(tmp_path)
    (tmp_path / "store").mkdir()
    dead = _shield(tmp_path, root, owner=77)  # no such process: a daemon that died
    dead.shield([100, 101])
    live = _shield(tmp_path, root)
    live.shield([102], inherited=5)
    fresh = _shield(tmp_path, root, owner=OWNER + 1)
    assert sorted(fresh.recover()) == [100, 101]
    assert [_adj(root, p) for p in (100, 101, 102)] == [0, 300, -1000]  # the live one's stays
    live.unshield()
    assert _adj(root, 102) == 5


def test_a_reused_pid_is_not_touched(tmp_path: Path) -> None:
    root = _proc(tmp_path)
    (tmp_path / "store").mkdir()
    shield = _shield(tmp_path, root, owner=77)
    shield.shield([100])
    stat = root / "100" / "stat"  # pid 100 exited; a new process got the number
    stat.write_text(stat.read_text().replace(" 500 ", " 900 "))
    (root / "100" / "oom_score_adj").write_text("-1000\n")
    _shield(tmp_path, root).recover()
    assert _adj(root, 100) == -1000


def test_a_refused_write_leaves_the_task_unshielded(tmp_path: Path) -> None:
    root = _proc(tmp_path)
    (tmp_path / "store").mkdir()
    (root / "101" / "oom_score_adj").unlink()
    (root / "101" / "oom_score_adj").mkdir()  # writing fails, as without CAP_SYS_RESOURCE
    shield = _shield(tmp_path, root)
    assert shield.shield([100, 101]) == [100]
    assert shield.original_of(101) is None
