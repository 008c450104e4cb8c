"""oomguard.store.ledger.FrozenLedger: who may settle an entry (owner alive or dead), traced tasks, zombies.

Most cases run on a fake /proc with os.kill recorded, not sent; the owner-liveness cases that
need the real /proc use `sleep` children, killed in finally.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import oomguard.store.ledger as ledger_module
from oomguard.sense.procfs import ProcReader
from oomguard.store.ledger import FrozenLedger
from tests.unit._support import FakeProc, fake_proc_tree

LIVE_OWNER, LIVE_OWNER_START = 50, 777  # an oomguard process that is still running
DEAD_OWNER, DEAD_OWNER_START = 999, 123  # one that is not (absent from /proc)
TRACER = 4321


class _KillRecorder(types.SimpleNamespace):
    """Stands in for `os` inside oomguard.store.ledger: os.kill is recorded, never sent."""

    def __init__(self) -> None:
        super().__init__(kills=[])

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def kill(self, pid: int, sig: int) -> None:
        self.kills.append((pid, sig))


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> _KillRecorder:
    fake = _KillRecorder()
    monkeypatch.setattr(ledger_module, "os", fake)
    return fake


def entry(pid: int, starttime: int, owner: int, owner_start: int, cgroup: str = "") -> dict[str, Any]:
    return {"pid": pid, "starttime": starttime, "cgroup": cgroup, "owner": owner,
            "owner_start": owner_start}


def write_entries(path: Path, entries: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(entries))


def read_entries(path: Path) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(path.read_text())
    return data


def set_tracer(proc_root: Path, pid: int, tracer: int) -> None:
    status = proc_root / str(pid) / "status"
    lines = [f"TracerPid:\t{tracer}" if line.startswith("TracerPid:") else line
             for line in status.read_text().splitlines()]
    status.write_text("\n".join(lines) + "\n")


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = fake_proc_tree(tmp_path / "proc", [
        FakeProc(LIVE_OWNER, 1, comm="oomguard", starttime=LIVE_OWNER_START),
        FakeProc(10, 1, starttime=5000),
        FakeProc(11, 1, starttime=5001),
        FakeProc(12, 1, starttime=5002),
        FakeProc(13, 1, starttime=5003),
        FakeProc(14, 1, state="Z", starttime=5004, rss_kib=None),
        FakeProc(16, 1, starttime=5006),
        FakeProc(17, 1, state="X", starttime=5007, rss_kib=None),
    ])
    set_tracer(root, 13, TRACER)
    return root


# -- fake /proc: which entries are settled -----------------------------------------------------------

@pytest.mark.parametrize(
    ("owner", "owner_start", "settled"),
    [
        (LIVE_OWNER, LIVE_OWNER_START, False),  # its owner still runs: hands off
        (LIVE_OWNER, LIVE_OWNER_START + 1, True),  # owner PID reused by another process
        (LIVE_OWNER, 0, True),  # owner start unknown: cannot be proved alive
        (DEAD_OWNER, DEAD_OWNER_START, True),
        (0, 0, True),  # written before entries had owners
        (-5, DEAD_OWNER_START, True),
    ],
    ids=["alive", "owner-pid-reused", "no-owner-start", "dead", "legacy", "negative-owner"],
)
def test_owner_liveness_decides(tmp_path: Path, proc_root: Path, kills: _KillRecorder,
                                owner: int, owner_start: int, settled: bool) -> None:
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(10, 5000, owner, owner_start)])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=12)  # some other process
    assert ledger.pending() is settled
    assert ledger.recover() == (["10"] if settled else [])
    assert kills.kills == ([(10, signal.SIGCONT)] if settled else [])
    assert read_entries(path) == ([] if settled else [entry(10, 5000, owner, owner_start)])
    assert ledger.pending() is False


@pytest.mark.parametrize(
    ("pid", "starttime", "why"),
    [(14, 5004, "zombie"), (17, 5007, "dead (X)"), (15, 5005, "gone"), (16, 9999, "pid reused")],
    ids=["zombie", "dead-task", "gone", "reused"],
)
def test_dead_owner_entries_never_thawed(tmp_path: Path, proc_root: Path, kills: _KillRecorder,
                                         pid: int, starttime: int, why: str) -> None:
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(pid, starttime, DEAD_OWNER, DEAD_OWNER_START)])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=12)
    assert ledger.pending() is True
    assert ledger.recover() == [], why
    assert kills.kills == []
    assert read_entries(path) == []  # settled: nothing left to do
    assert ledger.pending() is False


def test_traced_task_is_kept_until_its_tracer_lets_go(tmp_path: Path, proc_root: Path,
                                                      kills: _KillRecorder) -> None:
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(13, 5003, DEAD_OWNER, DEAD_OWNER_START)])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=12)
    for _ in range(2):  # and again: still kept
        assert ledger.recover() == []
        assert kills.kills == []
        assert read_entries(path) == [entry(13, 5003, DEAD_OWNER, DEAD_OWNER_START)]
        assert ledger.pending() is True
    set_tracer(proc_root, 13, 0)  # the dead owner's CRIU is done with it (and left it stopped)
    assert ledger.recover() == ["13"]
    assert kills.kills == [(13, signal.SIGCONT)]
    assert read_entries(path) == []
    assert ledger.pending() is False


def test_mixed_ledger(tmp_path: Path, proc_root: Path, kills: _KillRecorder) -> None:
    path = tmp_path / "frozen.json"
    alive = entry(10, 5000, LIVE_OWNER, LIVE_OWNER_START)
    traced = entry(13, 5003, DEAD_OWNER, DEAD_OWNER_START)
    write_entries(path, [
        alive,
        entry(11, 5001, LIVE_OWNER, LIVE_OWNER_START + 1),
        entry(12, 5002, DEAD_OWNER, DEAD_OWNER_START),
        traced,
        entry(14, 5004, DEAD_OWNER, DEAD_OWNER_START),
        entry(15, 5005, DEAD_OWNER, DEAD_OWNER_START),
        entry(16, 1, DEAD_OWNER, DEAD_OWNER_START),
    ])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=12)
    assert ledger.recover() == ["11", "12"]
    assert kills.kills == [(11, signal.SIGCONT), (12, signal.SIGCONT)]
    assert read_entries(path) == [alive, traced]
    assert ledger.pending() is True  # the traced one
    set_tracer(proc_root, 13, 0)
    assert ledger.recover() == ["13"]
    assert read_entries(path) == [alive]
    assert ledger.pending() is False  # the live owner's entry is not pending: it is that owner's


def test_own_entries_survive_own_recover(tmp_path: Path, proc_root: Path,
                                         kills: _KillRecorder) -> None:
    """recover() by the ledger's own owner (e.g. a second call) leaves its live entries."""
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=LIVE_OWNER)
    ledger.record([10, 11])
    assert [(e["owner"], e["owner_start"]) for e in read_entries(path)] == [
        (LIVE_OWNER, LIVE_OWNER_START)] * 2
    assert ledger.recover() == []
    assert kills.kills == []
    assert [e["pid"] for e in read_entries(path)] == [10, 11]
    assert ledger.pending() is False


def test_owner_without_start_time_never_counts_as_alive(tmp_path: Path, proc_root: Path,
                                                        kills: _KillRecorder) -> None:
    """A ledger whose owner is not in /proc writes owner_start 0: such entries are anyone's."""
    path = tmp_path / "frozen.json"
    orphan_writer = FrozenLedger(path, ProcReader(proc_root), owner=DEAD_OWNER)
    orphan_writer.record([10])
    assert read_entries(path) == [entry(10, 5000, DEAD_OWNER, 0)]
    assert orphan_writer.pending() is True
    assert FrozenLedger(path, ProcReader(proc_root), owner=12).recover() == ["10"]


def test_cgroup_entries_follow_owner(tmp_path: Path, proc_root: Path, kills: _KillRecorder) -> None:
    live_cg, dead_cg = tmp_path / "cg-live", tmp_path / "cg-dead"
    for cg in (live_cg, dead_cg):
        cg.mkdir()
        (cg / "cgroup.freeze").write_text("1")
    path = tmp_path / "frozen.json"
    live = entry(0, 0, LIVE_OWNER, LIVE_OWNER_START, str(live_cg))
    write_entries(path, [live, entry(0, 0, DEAD_OWNER, DEAD_OWNER_START, str(dead_cg))])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=12)
    assert ledger.recover() == [str(dead_cg)]
    assert (dead_cg / "cgroup.freeze").read_text() == "0"
    assert (live_cg / "cgroup.freeze").read_text() == "1"
    assert read_entries(path) == [live]
    assert kills.kills == []


# -- the real /proc ------------------------------------------------------------------------------------

def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _wait_state(pid: int, want: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    state = _state(pid)
    while state != want and time.monotonic() < deadline:
        time.sleep(0.005)
        state = _state(pid)
    return state


def _starttime(pid: int) -> int:
    return ProcReader("/proc").process(pid).starttime


def _absent_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 300, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free PID")


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two `sleep 30` children, the first one stopped (SIGSTOP)."""
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        os.kill(children[0].pid, signal.SIGSTOP)
        assert _wait_state(children[0].pid, "T") == "T"
        yield children
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=5)


def test_live_owner_entries_are_left_alone(tmp_path: Path,
                                           sleepers: list[subprocess.Popen[bytes]]) -> None:
    stopped, other = (c.pid for c in sleepers)
    path = tmp_path / "frozen.json"
    writer = FrozenLedger(path, ProcReader("/proc"), owner=os.getpid())
    writer.record([stopped])
    assert read_entries(path) == [entry(stopped, _starttime(stopped), os.getpid(),
                                        _starttime(os.getpid()))]
    before = path.read_text()
    reader = FrozenLedger(path, ProcReader("/proc"), owner=other)  # another live oomguard
    assert reader.pending() is False
    assert reader.recover() == []
    assert path.read_text() == before
    time.sleep(0.05)
    assert _state(stopped) == "T"  # never SIGCONT'd
    assert writer.recover() == []  # its own entries: still in use
    assert _state(stopped) == "T"


@pytest.mark.parametrize("owner_kind", ["absent-pid", "owner-pid-reused"])
def test_dead_owner_entries_are_settled(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]],
                                        owner_kind: str) -> None:
    stopped = sleepers[0].pid
    owner, owner_start = ((_absent_pid(), 123) if owner_kind == "absent-pid"
                          else (os.getpid(), _starttime(os.getpid()) + 1))
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(stopped, _starttime(stopped), owner, owner_start)])
    ledger = FrozenLedger(path, ProcReader("/proc"))  # owner: this process
    assert ledger.pending() is True
    assert ledger.recover() == [str(stopped)]
    assert _wait_state(stopped, "S") == "S"
    assert read_entries(path) == []
    assert ledger.pending() is False


def test_real_zombie_is_not_thawed(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    try:
        assert _wait_state(child.pid, "Z") == "Z"  # exited, not reaped yet
        path = tmp_path / "frozen.json"
        write_entries(path, [entry(child.pid, _starttime(child.pid), _absent_pid(), 123)])
        ledger = FrozenLedger(path, ProcReader("/proc"))
        assert ledger.recover() == []  # os.kill would "succeed" on a zombie: it must not be tried
        assert read_entries(path) == []
        assert ledger.pending() is False
    finally:
        child.wait(timeout=5)


PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17


def test_really_traced_task_is_kept(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    """A task really ptrace-attached (PTRACE_SEIZE from this thread), as CRIU holds one it dumps."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    stopped = sleepers[0].pid
    if libc.ptrace(PTRACE_SEIZE, stopped, None, None) != 0:
        pytest.skip(f"ptrace not permitted here: {os.strerror(ctypes.get_errno())}")
    # the kill in the fixture ends the tracee; the tracer (this thread) need not detach first
    assert ProcReader("/proc").process(stopped).tracer_pid == threading.get_native_id()
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(stopped, _starttime(stopped), _absent_pid(), 123)])
    ledger = FrozenLedger(path, ProcReader("/proc"))
    assert ledger.recover() == []
    assert ledger.pending() is True
    assert len(read_entries(path)) == 1
    assert _state(stopped) in ("T", "t")



def test_a_bystander_waits_until_the_dead_owners_dump_of_its_cgroup_mate_ends(
        tmp_path: Path, proc_root: Path, kills: _KillRecorder) -> None:
    path = tmp_path / "frozen.json"
    # 10 was held while 13 (traced: a CRIU of the dead owner still dumps it) was dumped; 11
    # waited for 16, whose dump is over (untraced), and 12 for a victim that is gone.
    waiting = {**entry(10, 5000, DEAD_OWNER, DEAD_OWNER_START), "waits_for": 13,
               "waits_for_start": 5003}
    write_entries(path, [
        waiting,
        {**entry(11, 5001, DEAD_OWNER, DEAD_OWNER_START), "waits_for": 16,
         "waits_for_start": 5006},
        {**entry(12, 5002, DEAD_OWNER, DEAD_OWNER_START), "waits_for": 15,
         "waits_for_start": 5005},
    ])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=LIVE_OWNER)
    assert sorted(ledger.recover()) == ["11", "12"]
    assert read_entries(path) == [waiting]
    assert ledger.pending() is True
    set_tracer(proc_root, 13, 0)  # that CRIU is done
    assert ledger.recover() == ["10"]
    assert read_entries(path) == []


def test_a_bystander_waits_for_its_mate_only_while_it_is_the_same_process(
        tmp_path: Path, proc_root: Path, kills: _KillRecorder) -> None:
    path = tmp_path / "frozen.json"
    write_entries(path, [{**entry(10, 5000, DEAD_OWNER, DEAD_OWNER_START), "waits_for": 13,
                          "waits_for_start": 4000}])  # pid 13 is another process now
    assert FrozenLedger(path, ProcReader(proc_root), owner=LIVE_OWNER).recover() == ["10"]


def test_bystanders_are_recorded_with_the_task_they_wait_for(tmp_path: Path,
                                                            proc_root: Path) -> None:
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=LIVE_OWNER)
    ledger.record([10, 11], waits_for=13)
    ledger.record([12])
    assert [(e["pid"], e.get("waits_for"), e.get("waits_for_start"))
            for e in read_entries(path)] == [(10, 13, 5003), (11, 13, 5003), (12, None, None)]


def test_an_owner_that_is_a_zombie_has_ended(tmp_path: Path, kills: _KillRecorder) -> None:
    """An orphaned owner (the standby of a dead daemon) waits as a zombie until its reaper
    comes: its entries are the next start's to settle at once."""
    root = fake_proc_tree(tmp_path / "proc", [
        FakeProc(60, 1, state="Z", starttime=600, rss_kib=None),
        FakeProc(10, 1, starttime=5000)])
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(10, 5000, 60, 600)])
    assert FrozenLedger(path, ProcReader(root), owner=12).recover() == ["10"]


def test_recorded_names_the_tasks_oomguard_stopped_whoever_recorded_them(
        tmp_path: Path, proc_root: Path) -> None:
    path = tmp_path / "frozen.json"
    write_entries(path, [entry(10, 5000, DEAD_OWNER, DEAD_OWNER_START),
                         entry(11, 4000, LIVE_OWNER, LIVE_OWNER_START),  # pid 11 reused since
                         entry(0, 0, LIVE_OWNER, LIVE_OWNER_START, cgroup="/sys/x")])
    ledger = FrozenLedger(path, ProcReader(proc_root), owner=LIVE_OWNER)
    assert ledger.recorded([10, 11, 12, 0]) == [10]
    assert ledger.recorded([]) == []
