"""The other processes of a victim's cgroup, held stopped while it is dumped: which ones
(oomguard.policy.bystanders, pure) and the holding itself (oomguard.act.bystanders, on real
sleeping child processes; the cgroup is a directory with a cgroup.procs file, which is all
that is read of it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from oomguard.act.bystanders import Bystanders
from oomguard.policy.bystanders import Bystander, to_hold
from oomguard.sense.procfs import ProcReader, StatFields
from oomguard.store.ledger import FrozenLedger
from tests.helpers import wait_until
from tests.unit._support import sleeping_processes, task_state

# -- which ones ------------------------------------------------------------------------------


def test_everyone_but_the_victims_tree_and_the_spared_is_held() -> None:
    found = [Bystander(10, 1, "S"), Bystander(11, 10, "R"), Bystander(20, 1, "S"),
             Bystander(30, 1, "D"), Bystander(40, 1, "S")]
    assert to_hold(found, victim={10}, spared={40}) == [20, 30]


def test_a_child_of_the_victim_is_the_freezes_not_a_bystander() -> None:
    # 12 was forked by the victim's child 11 while the tree was being stopped.
    found = [Bystander(11, 10, "R"), Bystander(12, 11, "R"), Bystander(20, 1, "R")]
    assert to_hold(found, victim={10}, spared=set()) == [20]


def test_stopped_traced_and_dead_tasks_are_left_alone() -> None:
    found = [Bystander(pid, 1, state) for pid, state in
             ((1, "T"), (2, "t"), (3, "Z"), (4, "X"), (5, "S"), (6, "R"), (7, "D"), (8, "I"))]
    assert to_hold(found, victim=set(), spared=set()) == [5, 6, 7, 8]


def test_a_parent_loop_in_the_readings_ends() -> None:
    found = [Bystander(5, 6, "S"), Bystander(6, 5, "S")]
    assert to_hold(found, victim={1}, spared=set()) == [5, 6]


# -- holding ---------------------------------------------------------------------------------


class _Cgroup:
    def __init__(self, path: Path, pids: list[int]) -> None:
        self.path = path
        path.mkdir(exist_ok=True)
        (path / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Five sleeping processes: [victim, a, b, c, oomguard] (the test's children are all
    descendants of the test: the stand-in for oomguard is a sibling of the others)."""
    with sleeping_processes(5) as pids:
        yield pids


def _bystanders(tmp_path: Path, oomguard: int, owner: int | None = None) -> Bystanders:
    proc = ProcReader()
    ledger = FrozenLedger(tmp_path / "frozen.json", proc, owner=owner)
    return Bystanders(proc, ledger, self_pid=oomguard)


def _recorded(tmp_path: Path) -> set[int]:
    import json

    path = tmp_path / "frozen.json"
    return {e["pid"] for e in json.loads(path.read_text() or "[]")} if path.exists() else set()


def test_the_others_are_stopped_recorded_and_continued(tmp_path: Path,
                                                        sleepers: list[int]) -> None:
    victim, a, b, user_stopped, me = sleepers
    os.kill(user_stopped, signal.SIGSTOP)
    assert wait_until(lambda: task_state(user_stopped) == "T", 5.0)
    cgroup = _Cgroup(tmp_path / "cg", sleepers[:4])
    hold = _bystanders(tmp_path, me)
    held = hold.hold(cgroup, [victim])  # type: ignore[arg-type]
    assert sorted(held.pids) == sorted([a, b])
    assert wait_until(lambda: task_state(a) == "T" and task_state(b) == "T", 5.0)
    assert task_state(victim) != "T"
    assert _recorded(tmp_path) == {a, b}  # before the stop: a crash continues them
    hold.release(held)
    assert wait_until(lambda: task_state(a) != "T" and task_state(b) != "T", 5.0)
    assert task_state(user_stopped) == "T"  # the user's stop is never undone
    assert _recorded(tmp_path) == set()
    assert held.pids == []
    hold.release(held)  # twice: nothing more


def test_one_the_user_stops_while_held_stays_stopped(tmp_path: Path,
                                                     sleepers: list[int]) -> None:
    victim, a, b, _c, me = sleepers
    cgroup = _Cgroup(tmp_path / "cg", [victim, a, b])
    hold = _bystanders(tmp_path, me)
    held = hold.hold(cgroup, [victim])  # type: ignore[arg-type]
    assert wait_until(lambda: task_state(a) == "T" and task_state(b) == "T", 5.0)
    os.kill(b, signal.SIGTSTP)  # Ctrl-Z while oomguard holds it: stays pending
    hold.release(held)
    assert wait_until(lambda: task_state(a) != "T", 5.0)
    time.sleep(0.05)
    assert task_state(b) == "T"


def test_a_task_two_dumps_hold_is_continued_by_the_last(tmp_path: Path,
                                                       sleepers: list[int]) -> None:
    first_victim, second_victim, shared, _c, me = sleepers
    hold = _bystanders(tmp_path, me)
    one = hold.hold(_Cgroup(tmp_path / "cg", [first_victim, shared]),  # type: ignore[arg-type]
                    [first_victim])
    assert wait_until(lambda: task_state(shared) == "T", 5.0)
    two = hold.hold(_Cgroup(tmp_path / "cg", [second_victim, shared]),  # type: ignore[arg-type]
                    [second_victim])
    assert one.pids == [shared] and two.pids == [shared]
    hold.release(one)
    hold.release(one)  # a dump's paths may release its hold twice: it counts once
    time.sleep(0.05)
    assert task_state(shared) == "T"
    assert _recorded(tmp_path) == {shared}
    hold.release(two)
    assert wait_until(lambda: task_state(shared) != "T", 5.0)
    # Not stopped twice: a second SIGSTOP would have stayed pending and read as the user's.
    assert _recorded(tmp_path) == set()


def test_a_victim_is_never_held_nor_continued_as_a_bystander(tmp_path: Path,
                                                            sleepers: list[int]) -> None:
    first_victim, later_victim, other, _c, me = sleepers
    hold = _bystanders(tmp_path, me)
    cgroup = _Cgroup(tmp_path / "cg", [first_victim, later_victim, other])
    held = hold.hold(cgroup, [first_victim])  # type: ignore[arg-type]
    assert sorted(held.pids) == sorted([later_victim, other])
    assert wait_until(lambda: task_state(later_victim) == "T" and task_state(other) == "T", 5.0)
    # Chosen by another checkpoint while held: stopped by oomguard, not by its user...
    with hold.victim([later_victim]):
        assert hold.held_now([later_victim, first_victim]) == [later_victim]
        hold.release(held)  # ...and not continued under that checkpoint's feet
        assert wait_until(lambda: task_state(other) != "T", 5.0)
        assert task_state(later_victim) == "T"
        assert hold.hold(cgroup, [first_victim]).pids == [other]  # type: ignore[arg-type]
    assert hold.held_now([later_victim]) == []


def test_oomguard_and_the_requester_are_spared(tmp_path: Path, sleepers: list[int]) -> None:
    victim, requester, other, _c, me = sleepers
    cgroup = _Cgroup(tmp_path / "cg", [victim, requester, other, me, os.getpid()])
    hold = _bystanders(tmp_path, me)
    held = hold.hold(cgroup, [victim], requester=requester)  # type: ignore[arg-type]
    assert held.pids == [other]
    assert wait_until(lambda: task_state(other) == "T", 5.0)
    hold.release(held)
    assert wait_until(lambda: task_state(other) != "T", 5.0)


def test_a_dead_holders_bystanders_are_continued_at_the_next_start(
        tmp_path: Path, sleepers: list[int]) -> None:
    victim, a, _b, _c, me = sleepers
    gone = subprocess.Popen(["true"])
    gone.wait()  # the "daemon" that held them, dead since
    held = _bystanders(tmp_path, me, owner=gone.pid).hold(
        _Cgroup(tmp_path / "cg", [victim, a]), [victim])  # type: ignore[arg-type]
    assert held.pids == [a]
    assert wait_until(lambda: task_state(a) == "T", 5.0)
    assert FrozenLedger(tmp_path / "frozen.json", ProcReader()).recover() == [str(a)]
    assert wait_until(lambda: task_state(a) != "T", 5.0)


def test_a_cgroup_gone_holds_nobody(tmp_path: Path) -> None:
    cgroup = _Cgroup(tmp_path / "cg", [])
    (cgroup.path / "cgroup.procs").unlink()
    cgroup.path.rmdir()
    assert _bystanders(tmp_path, os.getpid()).hold(cgroup, [1]).pids == []  # type: ignore[arg-type]


def test_only_a_cgroup_with_a_limit_to_share_has_bystanders_held(tmp_path: Path) -> None:
    """Never the rest of an unlimited cgroup (the root one a system rule's victim may live in:
    holding it would stop the machine for the dump)."""
    from oomguard.cgroup.v1 import V1MemoryCgroup
    from oomguard.lifecycle.dumproom import limited as has_limit

    mount = tmp_path / "memory"
    limited, unlimited, gone = (V1MemoryCgroup(mount / n, mount) for n in ("a", "b", "c"))
    for cg, text in ((limited, str(256 << 20)), (unlimited, "9223372036854771712")):
        cg.path.mkdir(parents=True)
        (cg.path / "memory.limit_in_bytes").write_text(text + "\n")
    assert has_limit(limited) and not has_limit(unlimited) and not has_limit(gone)


def test_a_task_under_ptrace_is_left_alone_whatever_its_state() -> None:
    """A CRIU of a dead daemon still dumping it: its parasite runs in the task (R or S, not
    t), and a SIGSTOP from the standby there made CRIU fail ('stopped by 19 unexpectedly')."""
    found = [Bystander(5, 1, "R", traced=True), Bystander(6, 1, "S", traced=True),
             Bystander(7, 1, "S")]
    assert to_hold(found, victim=set(), spared=set()) == [7]


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (a real tracer)")
def test_a_task_a_tracer_holds_is_not_stopped(tmp_path: Path, sleepers: list[int]) -> None:
    """As a dead daemon's CRIU holds its victim (the standby held it there, and the dump
    failed): a task under ptrace, sleeping (S, not t), is neither stopped nor recorded."""
    _victim, traced, free, _c, me = sleepers
    tracer = subprocess.Popen(["strace", "-qq", "-o", "/dev/null", "-p", str(traced)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        proc = ProcReader()
        assert wait_until(lambda: proc.status(traced).tracer_pid == tracer.pid, 5.0)
        # What the state alone showed, once strace's attach has let it run on (it is in a
        # tracing stop, t, for a moment while strace seizes it: the failure of one suite).
        assert wait_until(lambda: task_state(traced) != "t", 5.0)
        hold = _bystanders(tmp_path, me)
        held = hold.hold(_Cgroup(tmp_path / "cg", [traced, free]), ())  # type: ignore[arg-type]
        assert held.pids == [free] and _recorded(tmp_path) == {free}
        hold.release(held)
    finally:
        tracer.terminate()
        tracer.wait(timeout=10)


def test_what_comes_into_the_cgroup_during_the_dump_is_held_and_continued_with_the_rest(
        tmp_path: Path, sleepers: list[int]) -> None:
    """follow(): a task written into the cgroup after the hold is held too (recorded first),
    one CRIU is restoring there is not, and release() ends the watch and continues it."""
    victim, a, newcomer, restoring, me = sleepers
    CRIU = 4_000_000
    cgroup = _Cgroup(tmp_path / "cg", [victim, a])
    hold = _bystanders(tmp_path, me)
    real_stat = hold.proc.stat

    def stat(pid: int) -> StatFields:  # `restoring`'s parent is a criu (a restore under way)
        if pid == CRIU:
            return replace(real_stat(me), pid=CRIU, comm="criu")
        found = real_stat(pid)
        return replace(found, ppid=CRIU) if pid == restoring else found
    hold.proc.stat = stat  # type: ignore[method-assign]
    held = hold.hold(cgroup, [victim])  # type: ignore[arg-type]
    hold.follow(cgroup, [victim], None, held, interval=0.005)  # type: ignore[arg-type]
    assert held.pids == [a]
    (cgroup.path / "cgroup.procs").write_text(f"{victim}\n{a}\n{newcomer}\n{restoring}\n")
    assert wait_until(lambda: task_state(newcomer) == "T", 5.0)
    assert wait_until(lambda: newcomer in held.pids, 5.0) and newcomer in _recorded(tmp_path)
    assert restoring not in held.pids and task_state(restoring) != "T"
    hold.release(held)
    assert wait_until(lambda: task_state(newcomer) != "T" and task_state(a) != "T", 5.0)
    assert not hold._follows and _recorded(tmp_path) == set()
