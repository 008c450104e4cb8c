"""oomguard.store.ledger: the frozen-task ledger (PID + start time, cgroup freezes) and SavedLimits."""

from __future__ import annotations

import json
import os
import signal
import stat
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
from oomguard.store.ledger import FrozenEntry, FrozenLedger, JsonRecord, SavedLimits
from tests.unit._support import FakeProc, fake_proc_tree


def _entries(path: Path) -> list[dict[str, Any]]:
    """The ledger's entries without their owner fields (covered by the owner tests below)."""
    data: list[dict[str, Any]] = json.loads(path.read_text())
    return [{k: v for k, v in e.items() if k not in ("owner", "owner_start")} for e in data]


class _KillRecorder(types.SimpleNamespace):
    """Stands in for `os` inside oomguard.store.ledger: os.kill is recorded, never sent."""

    def __init__(self, missing: frozenset[int] = frozenset()) -> None:
        super().__init__(kills=[])
        self._missing = missing

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def kill(self, pid: int, sig: int) -> None:
        if pid in self._missing:
            raise ProcessLookupError(pid)
        self.kills.append((pid, sig))


@pytest.fixture
def fake_proc(tmp_path: Path) -> ProcReader:
    root = fake_proc_tree(tmp_path / "proc", [
        FakeProc(10, 1, starttime=5000),
        FakeProc(11, 10, starttime=5001),
        FakeProc(12, 10, starttime=5002),
    ])
    return ProcReader(root)


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> _KillRecorder:
    fake = _KillRecorder()
    monkeypatch.setattr(ledger_module, "os", fake)
    return fake


# -- record / clear ------------------------------------------------------------------------------

def test_record_stores_pid_and_starttime(tmp_path: Path, fake_proc: ProcReader) -> None:
    path = tmp_path / "state" / "frozen.json"
    FrozenLedger(path, fake_proc).record([10, 11, 999])  # 999 is gone: skipped
    assert _entries(path) == [{"pid": 10, "starttime": 5000, "cgroup": ""},
                              {"pid": 11, "starttime": 5001, "cgroup": ""}]
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert not path.with_name("frozen.json.tmp").exists()


def test_record_keeps_one_entry_per_pid(tmp_path: Path, fake_proc: ProcReader) -> None:
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, fake_proc)
    ledger.record([10, 11])
    ledger.record([11, 12, 10])
    assert sorted((e["pid"], e["starttime"]) for e in _entries(path)) == [
        (10, 5000), (11, 5001), (12, 5002)]


def test_record_replaces_stale_entry_for_reused_pid(tmp_path: Path, fake_proc: ProcReader) -> None:
    path = tmp_path / "frozen.json"
    path.write_text(json.dumps([{"pid": 10, "starttime": 42, "cgroup": ""}]))  # an older process 10
    FrozenLedger(path, fake_proc).record([10])
    assert [(e["pid"], e["starttime"]) for e in _entries(path)] == [(10, 5000)]


def test_writes_are_in_place_and_always_whole_json(tmp_path: Path, fake_proc: ProcReader) -> None:
    """No temporary file and no rename (one pwrite on the hot path to SIGSTOP): the same inode
    throughout, and a shrinking write leaves exactly the new text behind."""
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, fake_proc)
    ledger.record([10, 11, 12])
    inode = path.stat().st_ino
    ledger.clear([10, 11])
    assert path.stat().st_ino == inode
    text = path.read_bytes()
    assert text == text.rstrip() and json.loads(text)[0]["pid"] == 12
    ledger.clear([12])
    assert path.read_bytes() == b"[]" and path.stat().st_ino == inode


def test_a_padded_ledger_is_read(tmp_path: Path, fake_proc: ProcReader) -> None:
    """What a process that died between the padded write and the truncation leaves."""
    path = tmp_path / "frozen.json"
    path.write_text(json.dumps([{"pid": 11, "starttime": 5001, "cgroup": ""}]) + " " * 200)
    ledger = FrozenLedger(path, fake_proc)
    assert [e.pid for e in ledger._load()] == [11]
    ledger.record([12])
    assert [e["pid"] for e in _entries(path)] == [11, 12]


def test_two_writers_lose_nothing(tmp_path: Path, fake_proc: ProcReader) -> None:
    """The daemon and a CLI each have their ledger object on one file: flock, not the
    in-process lock, keeps one's entries from being written over by the other's."""
    path = tmp_path / "frozen.json"
    first, second = FrozenLedger(path, fake_proc), FrozenLedger(path, fake_proc)

    def churn(ledger: FrozenLedger, cgroup: str) -> None:
        for _ in range(200):
            ledger.record_cgroup(tmp_path / cgroup)
            ledger.record([10])

    threads = [threading.Thread(target=churn, args=(first, "a")),
               threading.Thread(target=churn, args=(second, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(e["cgroup"] for e in _entries(path)) == ["", str(tmp_path / "a"),
                                                           str(tmp_path / "b")]


def test_clear_removes_pids_but_keeps_cgroups(tmp_path: Path, fake_proc: ProcReader) -> None:
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, fake_proc)
    ledger.record([10, 11, 12])
    ledger.record_cgroup(tmp_path / "cg")
    ledger.clear([11, 0, 999])  # pid 0 does not clear the cgroup entry
    assert [(e["pid"], e["cgroup"]) for e in _entries(path)] == [
        (10, ""), (12, ""), (0, str(tmp_path / "cg"))]
    ledger.clear([10, 12])
    assert _entries(path) == [{"pid": 0, "starttime": 0, "cgroup": str(tmp_path / "cg")}]


def test_record_cgroup_once_and_clear_cgroup(tmp_path: Path, fake_proc: ProcReader) -> None:
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, fake_proc)
    a, b = tmp_path / "a", tmp_path / "b"
    ledger.record_cgroup(a)
    ledger.record_cgroup(a)
    ledger.record_cgroup(b)
    ledger.record([10])
    assert [e["cgroup"] for e in _entries(path)] == [str(a), str(b), ""]
    ledger.clear_cgroup(a)
    assert [(e["pid"], e["cgroup"]) for e in _entries(path)] == [(0, str(b)), (10, "")]
    ledger.clear_cgroup(tmp_path / "never-recorded")
    assert len(_entries(path)) == 2


@pytest.mark.parametrize(
    "garbage",
    ["", "not json", "{", "null", "42", '"text"', '{"pid": 10, "starttime": 5000}',
     '[{"pid": 10}]', '[{"starttime": 5000}]', '[{"pid": "ten", "starttime": 5000}]', "[1, 2]",
     '[{"pid": null, "starttime": 1}]'],
)
def test_garbage_ledger_is_empty(tmp_path: Path, fake_proc: ProcReader, kills: _KillRecorder,
                                 garbage: str) -> None:
    path = tmp_path / "frozen.json"
    path.write_text(garbage)
    ledger = FrozenLedger(path, fake_proc)
    assert ledger.recover() == []
    assert kills.kills == []
    assert _entries(path) == []
    path.write_text(garbage)
    ledger.record([12])  # starts afresh
    assert _entries(path) == [{"pid": 12, "starttime": 5002, "cgroup": ""}]


def test_missing_ledger_recovers_nothing(tmp_path: Path, fake_proc: ProcReader,
                                         kills: _KillRecorder) -> None:
    path = tmp_path / "sub" / "frozen.json"
    assert FrozenLedger(path, fake_proc).recover() == []
    assert _entries(path) == []
    assert kills.kills == []


# -- recover on a fake /proc (signals recorded, not sent) ----------------------------------------

@pytest.mark.parametrize(
    ("entries", "signalled"),
    [
        ([(10, 5000), (11, 5001)], [10, 11]),
        ([(10, 5000), (11, 9999)], [10]),  # 11 was reused by another process: untouched
        ([(10, 1), (11, 2), (12, 3)], []),
        ([(999, 5000), (12, 5002)], [12]),  # 999 is gone
        ([], []),
    ],
    ids=["all-match", "one-reused", "all-reused", "one-gone", "empty"],
)
def test_recover_signals_only_matching_start_times(
        tmp_path: Path, fake_proc: ProcReader, kills: _KillRecorder,
        entries: list[tuple[int, int]], signalled: list[int]) -> None:
    path = tmp_path / "frozen.json"
    path.write_text(json.dumps([FrozenEntry(pid, st).__dict__ for pid, st in entries]))
    thawed = FrozenLedger(path, fake_proc).recover()
    assert thawed == [str(p) for p in signalled]
    assert kills.kills == [(p, signal.SIGCONT) for p in signalled]
    assert _entries(path) == []


def test_recover_process_exiting_before_sigcont(tmp_path: Path, fake_proc: ProcReader,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _KillRecorder(missing=frozenset({11}))
    monkeypatch.setattr(ledger_module, "os", fake)
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, fake_proc)
    ledger.record([10, 11])
    assert ledger.recover() == ["10"]
    assert fake.kills == [(10, signal.SIGCONT)]


# -- recover of cgroup freezes -------------------------------------------------------------------

def test_recover_thaws_recorded_cgroups(tmp_path: Path, fake_proc: ProcReader,
                                        kills: _KillRecorder) -> None:
    cg = tmp_path / "cgroup" / "jobs"
    cg.mkdir(parents=True)
    (cg / "cgroup.freeze").write_text("1\n")
    gone = tmp_path / "cgroup" / "removed"  # removed since: nothing to thaw
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, fake_proc)
    ledger.record_cgroup(cg)
    ledger.record_cgroup(gone)
    ledger.record([10])
    assert ledger.recover() == [str(cg), "10"]
    assert (cg / "cgroup.freeze").read_text() == "0"
    assert not gone.exists()
    assert kills.kills == [(10, signal.SIGCONT)]
    assert _entries(path) == []


def test_recover_after_clear_cgroup_leaves_cgroup_alone(tmp_path: Path, fake_proc: ProcReader) -> None:
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cgroup.freeze").write_text("1")
    ledger = FrozenLedger(tmp_path / "frozen.json", fake_proc)
    ledger.record_cgroup(cg)
    ledger.clear_cgroup(cg)
    assert ledger.recover() == []
    assert (cg / "cgroup.freeze").read_text() == "1"


# -- recover with real (child) processes ---------------------------------------------------------

def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rpartition(")")[2].split()[0]


def _wait_state(pid: int, want: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    state = _state(pid)
    while state != want and time.monotonic() < deadline:
        time.sleep(0.005)
        state = _state(pid)
    return state


@pytest.fixture
def stopped_children() -> Iterator[list[subprocess.Popen[bytes]]]:
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        for child in children:
            os.kill(child.pid, signal.SIGSTOP)
            assert _wait_state(child.pid, "T") == "T"
        yield children
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=5)


def test_recover_sigconts_real_stopped_process(tmp_path: Path,
                                               stopped_children: list[subprocess.Popen[bytes]]) -> None:
    ours, reused = (c.pid for c in stopped_children)
    path = tmp_path / "frozen.json"
    ledger = FrozenLedger(path, ProcReader("/proc"))
    ledger.record([ours, reused])
    recorded = {e["pid"]: e["starttime"] for e in _entries(path)}
    assert recorded[ours] == int(Path(f"/proc/{ours}/stat").read_text().rpartition(")")[2].split()[19])
    # Pretend `reused` is a new process that took the PID of one we had stopped.
    path.write_text(json.dumps([{"pid": ours, "starttime": recorded[ours], "cgroup": ""},
                                {"pid": reused, "starttime": recorded[reused] + 1, "cgroup": ""}]))
    assert ledger.recover() == [str(ours)]
    assert _wait_state(ours, "S") == "S"
    time.sleep(0.05)
    assert _state(reused) == "T"  # never signalled
    assert _entries(path) == []


# -- SavedLimits ---------------------------------------------------------------------------------

def test_saved_limits_remember_keeps_first_value(tmp_path: Path) -> None:
    path = tmp_path / "state" / "saved-high.json"
    saved = SavedLimits(path)
    assert saved.remember("/sys/fs/cgroup/jobs", 200 << 20) == 200 << 20
    # oomguard then set memory.high itself; the next read must still give the user's value
    assert saved.remember("/sys/fs/cgroup/jobs", 150 << 20) == 200 << 20
    assert SavedLimits(path).remember("/sys/fs/cgroup/jobs", 1) == 200 << 20  # survives a restart
    assert json.loads(path.read_text()) == {"/sys/fs/cgroup/jobs": 200 << 20}


def test_saved_limits_forget(tmp_path: Path) -> None:
    path = tmp_path / "saved.json"
    saved = SavedLimits(path)
    saved.remember("a", 1)
    saved.remember("b", 2)
    saved.forget("a")
    assert json.loads(path.read_text()) == {"b": 2}
    assert saved.remember("a", 3) == 3  # forgotten: the current value is the original again
    saved.forget("never-there")
    assert json.loads(path.read_text()) == {"a": 3, "b": 2}


def test_saved_limits_forget_without_file_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "saved.json"
    SavedLimits(path).forget("x")
    assert not path.exists()


def test_saved_limits_none_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "saved.json"
    saved = SavedLimits(path)
    assert saved.remember("max-cg", None) is None
    assert saved.remember("max-cg", 100 << 20) is None  # 'max' was the original
    assert SavedLimits(path).remember("max-cg", 5) is None
    assert json.loads(path.read_text()) == {"max-cg": None}
    saved.forget("max-cg")
    assert json.loads(path.read_text()) == {}
    assert saved.remember("max-cg", 7) == 7


@pytest.mark.parametrize("garbage", ["", "not json", "[1, 2]", "null", "42", '"x"'])
def test_saved_limits_garbage_is_empty(tmp_path: Path, garbage: str) -> None:
    path = tmp_path / "saved.json"
    path.write_text(garbage)
    assert SavedLimits(path).remember("k", 9) == 9
    assert json.loads(path.read_text()) == {"k": 9}


@pytest.mark.parametrize("garbage", ['{"other": "max"}', '{"other": [1]}'])
def test_saved_limits_bad_values_are_ignored(tmp_path: Path, garbage: str) -> None:
    path = tmp_path / "saved.json"
    path.write_text(garbage)
    assert SavedLimits(path).remember("k", 9) == 9


def test_note_writes_only_what_this_process_has_not_recorded(tmp_path: Path) -> None:
    """The freeze notes each task before its SIGSTOP: the tree recorded before it costs no
    write; a task cleared is noted (written) again."""
    mine = os.getpid()
    ledger = FrozenLedger(tmp_path / "frozen.json")
    ledger.record([mine])
    before = (tmp_path / "frozen.json").stat().st_mtime_ns, (tmp_path / "frozen.json").read_text()
    ledger.note([mine])
    assert ((tmp_path / "frozen.json").stat().st_mtime_ns,
            (tmp_path / "frozen.json").read_text()) == before
    ledger.clear([mine])
    assert ledger.recorded([mine]) == []
    ledger.note([mine])
    assert ledger.recorded([mine]) == [mine]


def test_entries_of_another_live_oomguard_are_held_elsewhere(tmp_path: Path) -> None:
    """A relieved standby still on its way out: not pending (it lives), but held elsewhere,
    so the daemon looks again soon; once it is gone they are pending."""
    path = tmp_path / "frozen.json"
    other = subprocess.Popen(["sleep", "60"])
    try:
        FrozenLedger(path, owner=other.pid).record([os.getpid()])
        daemon = FrozenLedger(path)
        assert daemon.held_elsewhere() and not daemon.pending()
        other.kill()
        other.wait()
        assert daemon.pending() and not daemon.held_elsewhere()
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    daemon.record([os.getpid()])  # the daemon's own: neither
    assert not daemon.held_elsewhere() and not daemon.pending()


def test_a_json_record_reads_nothing_from_a_missing_or_bad_file_and_writes_whole(
        tmp_path: Path) -> None:
    """store.ledger.JsonRecord: the file of the saved limits, the lifts and the OOM shield."""
    path = tmp_path / "record.json"
    record = JsonRecord(path, sync=False, mode=0o644)
    assert record.read() is None  # missing
    for bad in (b"{", b"\xff", b"[" * 100_000):  # malformed, not text, nested past the recursion
        path.write_bytes(bad)
        assert record.read() is None
    record.write({"a": [1, None]})
    assert record.read() == {"a": [1, None]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]
    record.remove()
    record.remove()  # gone already: no error
    assert not path.exists()
