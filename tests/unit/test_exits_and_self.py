"""Never checkpoint yourself (selfguard), and the restored root's exit: its status in words,
the watch (exitwatch) on real child processes, meta.json. (The connector's messages in kernel
layout: test_procevents.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from oomguard.lifecycle.exitwatch import (
    ExitWatch,
    describe_exit,
    exit_fields,
    record_exit,
    rewatch_restored,
)
from oomguard.model.errors import CheckpointFailed
from oomguard.sense.cnproc import ProcessEvent, ProcessExit, ProcessFork
from oomguard.sense.procevents import EventBatch
from oomguard.sense.procfs import ProcReader
from oomguard.sense.selfguard import own_family, own_tree_members, refuse_own_tree
from oomguard.store.checkpoints import CheckpointMeta, Store
from tests.helpers import wait_until
from tests.unit._support import FakeProc, fake_proc_tree

# -- selfguard ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("root", "self_chain", "root_chain", "requester_chain", "found"),
    [(10, [50, 40, 1], [10, 1], [], []),  # unrelated
     (40, [50, 40, 1], [40, 1], [], [(50, "oomguard itself")]),  # oomguard's parent
     (50, [50, 40, 1], [50, 40, 1], [], [(50, "oomguard itself")]),
     (60, [50, 40, 1], [60, 50, 40, 1], [], [(60, "a process oomguard runs")]),  # its CRIU
     (10, [50, 1], [10, 1], [11, 10, 1], [(11, "the process asking for the checkpoint")]),
     (10, [50, 1], [10, 1], [12, 9, 1], []),  # the caller elsewhere: fine
     (40, [50, 40, 1], [40, 1], [50, 40, 1], [(50, "oomguard itself")])],  # asking itself
)
def test_own_tree_members(root: int, self_chain: list[int], root_chain: list[int],
                          requester_chain: list[int], found: list[tuple[int, str]]) -> None:
    assert own_tree_members(root, self_chain, root_chain, requester_chain) == found


@pytest.fixture
def proc(tmp_path: Path) -> ProcReader:
    # 100 (a shell script) -> 200 (oomguard CLI) -> 300 (its CRIU); 100 -> 110 (the job)
    return ProcReader(fake_proc_tree(tmp_path / "proc", [
        FakeProc(100, 1, comm="sh", children={100: [110, 200]}),
        FakeProc(110, 100, comm="job"),
        FakeProc(200, 100, comm="oomguard", children={200: [300]}),
        FakeProc(300, 200, comm="criu"),
    ]))


def test_a_tree_holding_oomguard_is_refused_untouched(proc: ProcReader) -> None:
    with pytest.raises(CheckpointFailed) as refused:
        refuse_own_tree(100, proc, self_pid=200)
    assert refused.value.outcome == "untouched"
    assert "contains 200 (oomguard itself)" in str(refused.value)
    assert "refused before stopping it" in str(refused.value)


def test_a_tree_holding_the_caller_is_refused(proc: ProcReader) -> None:
    with pytest.raises(CheckpointFailed, match=r"200 \(the process asking"):
        refuse_own_tree(100, proc, requester=200, self_pid=999)


def test_oomguards_family_is_never_a_victim(proc: ProcReader) -> None:
    """Its descendants (CRIU) and its ancestors (the script that started it: a tree rooted
    there holds oomguard); not its siblings."""
    assert own_family(proc, self_pid=200) == {100, 200, 300}
    assert own_family(proc, self_pid=300) == {100, 200, 300}
    assert 110 not in own_family(proc, self_pid=200)


def test_what_oomguard_runs_is_refused(proc: ProcReader) -> None:
    with pytest.raises(CheckpointFailed, match=r"300 \(a process oomguard runs\)"):
        refuse_own_tree(300, proc, self_pid=200)


def test_the_job_alone_is_fine(proc: ProcReader) -> None:
    refuse_own_tree(110, proc, requester=200, self_pid=200)
    refuse_own_tree(4242, proc, self_pid=200)  # gone: the checkpoint finds that out itself


# -- exit statuses in words -----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("status", "code", "sig", "fields", "text"),
    [(3 << 8, 3, None, {"exit_status": 3, "exit_signal": None}, "exited with status 3"),
     (0, 0, None, {"exit_status": 0, "exit_signal": None}, "exited with status 0"),
     (9, None, 9, {"exit_status": None, "exit_signal": "SIGKILL"}, "killed by SIGKILL"),
     (0x80 | 11, None, 11, {"exit_status": None, "exit_signal": "SIGSEGV"}, "killed by SIGSEGV")],
)
def test_exit_status_decoding(status: int, code: int | None, sig: int | None,
                              fields: dict[str, Any], text: str) -> None:
    exit_ = ProcessExit(1, 1, status)
    assert (exit_.exit_code, exit_.signal) == (code, sig)
    assert exit_fields(exit_) == fields
    assert describe_exit(exit_) == text


def test_unknown_status() -> None:
    assert exit_fields(None) == {"exit_status": None, "exit_signal": None}
    assert describe_exit(None) == "unknown"


# -- record_exit -------------------------------------------------------------------------------------

def stored(tmp_path: Path, restored_pid: int | None) -> Store:
    store = Store(tmp_path / "store")
    meta = CheckpointMeta(id="job-1", pid=70, pids=[70], command="job", comm="job", uid=0,
                          user="root", cgroup="/a", cgroup_version=1, rss_bytes=1,
                          reason="test", criu_version="4.2", created=1.0)
    _images, fd = store.begin(meta)
    os.close(fd)
    store.commit(meta)
    meta.state, meta.restored_pid = "restored", restored_pid
    store.update(meta)
    return store


def test_record_exit_writes_meta(tmp_path: Path) -> None:
    store = stored(tmp_path, 70)
    fields = record_exit(store, "job-1", 70, 123.5, ProcessExit(70, 70, 3 << 8))
    assert fields == {"exited_at": 123.5, "exit_status": 3, "exit_signal": None,
                      "status": "exited with status 3"}
    meta = store.get("job-1")
    assert (meta.exited_at, meta.exit_status, meta.exit_signal) == (123.5, 3, None)


def test_record_exit_leaves_a_later_restore_and_a_forgotten_one_alone(tmp_path: Path) -> None:
    store = stored(tmp_path, 71)  # restored again since, as pid 71
    record_exit(store, "job-1", 70, 1.0, None)
    assert store.get("job-1").exited_at is None
    store.forget("job-1")
    assert record_exit(store, "job-1", 71, 2.0, None)["status"] == "unknown"


# -- ExitWatch on real processes ------------------------------------------------------------------

class FakeEvents:
    """Stands in for the connector: a pipe to poll, and the exits the test queues."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.queued: list[ProcessEvent] = []
        self.lost = 0
        self.closed = False

    def fileno(self) -> int:
        return self.r

    def push(self, event: ProcessEvent, lost: int = 0) -> None:
        self.queued.append(event)
        self.lost += lost
        os.write(self.w, b"x")

    def read(self) -> EventBatch:
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 4096)
        out, self.queued = self.queued, []
        lost, self.lost = self.lost, 0
        return EventBatch(tuple(out), lost)

    def close(self) -> None:
        self.closed = True
        os.close(self.r)
        os.close(self.w)


class Reports:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, ProcessExit | None]] = []
        self.event = threading.Event()

    def __call__(self, checkpoint_id: str, pid: int, exited_at: float,
                 status: ProcessExit | None) -> None:
        self.seen.append((checkpoint_id, pid, status))
        self.event.set()


def test_exit_with_its_status_from_the_connector() -> None:
    events, reports = FakeEvents(), Reports()
    watch = ExitWatch(reports, open_events=lambda: events)
    since = watch.expect(60)
    child = subprocess.Popen(["sleep", "30"])
    try:
        watch.watch("job-1", child.pid, since)
        events.push(ProcessExit(child.pid, child.pid, 1 << 8, since - 1))  # an earlier process's
        events.push(ProcessFork(child.pid, child.pid, child.pid + 1, child.pid + 1, since + 1))
        events.push(ProcessExit(child.pid + 7, child.pid, 0, since + 2))  # one of its threads
        child.send_signal(signal.SIGTERM)
        child.wait()
        events.push(ProcessExit(child.pid, child.pid, signal.SIGTERM, since + 10**12))
        assert reports.event.wait(10)
    finally:
        child.kill()
        watch.close()
    assert reports.seen == [("job-1", child.pid,
                             ProcessExit(child.pid, child.pid, signal.SIGTERM, since + 10**12))]
    assert events.closed


def test_events_the_connector_lost_are_the_reason_a_status_is_unknown() -> None:
    """ENOBUFS: the socket's buffer overflowed; the root's exit may be among the lost."""
    events, reports = FakeEvents(), Reports()
    watch = ExitWatch(reports, open_events=lambda: events)
    since = watch.expect(60)
    assert watch.why_unknown() is None
    child = subprocess.Popen(["sleep", "30"])
    try:
        watch.watch("job-4", child.pid, since)
        events.push(ProcessFork(1, 1, 2, 2, since + 1), lost=2)
        child.kill()
        child.wait()
        assert reports.event.wait(10)  # the pidfd says when; no status came
    finally:
        watch.close()
    assert reports.seen == [("job-4", child.pid, None)]
    assert watch.events_lost == 2
    assert "ENOBUFS, 2x" in (watch.why_unknown() or "")


def test_exit_without_the_connector_is_recorded_as_unknown() -> None:
    reports = Reports()

    def unavailable() -> Any:
        raise PermissionError(1, "Operation not permitted")

    watch = ExitWatch(reports, open_events=unavailable)
    since = watch.expect(60)
    assert watch.why_no_status == ("process-event connector unavailable "
                                   "(EPERM: no CAP_NET_ADMIN)")
    assert watch.why_unknown() == watch.why_no_status
    child = subprocess.Popen(["sleep", "30"])
    try:
        watch.watch("job-2", child.pid, since)
        child.kill()
        child.wait()
        assert reports.event.wait(10)
    finally:
        watch.close()
    assert reports.seen == [("job-2", child.pid, None)]


def test_a_root_gone_before_it_is_watched_is_reported_at_once() -> None:
    reports = Reports()
    watch = ExitWatch(reports, open_events=lambda: (_ for _ in ()).throw(OSError(1, "no")))
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: no pidfd can be had any more
    try:
        watch.watch("job-3", child.pid, 0)
    finally:
        watch.close()
    assert reports.seen == [("job-3", child.pid, None)]


def test_a_watch_after_the_connector_was_closed_opens_it_again() -> None:
    """expect(0) then watch(): the thread may close the connector in between (nothing watched,
    time up); the watch opens it again, and the exit still comes with its status. (A daemon
    restarted meanwhile lost the status this way in CI.)"""
    opened: list[FakeEvents] = []

    def open_events() -> FakeEvents:
        opened.append(FakeEvents())
        return opened[-1]

    reports = Reports()
    watch = ExitWatch(reports, open_events=open_events)
    since = watch.expect(0)
    assert wait_until(lambda: opened[0].closed, 10)  # the thread found nothing to do
    child = subprocess.Popen(["sleep", "30"])
    try:
        watch.watch("job-5", child.pid, since)
        assert len(opened) == 2 and not opened[1].closed
        opened[1].push(ProcessExit(child.pid, child.pid, 4 << 8, since + 10**12))
        child.terminate()
        child.wait()
        assert reports.event.wait(10)
    finally:
        child.kill()
        watch.close()
    assert reports.seen == [("job-5", child.pid,
                             ProcessExit(child.pid, child.pid, 4 << 8, since + 10**12))]


class Recorder:
    def __init__(self) -> None:
        self.expected: list[float] = []
        self.watched: list[tuple[str, int, int]] = []

    def clock_ns(self) -> int:
        return 77

    def expect(self, seconds: float) -> int:
        self.expected.append(seconds)
        return 77

    def watch(self, checkpoint_id: str, pid: int, since_ns: int) -> None:
        self.watched.append((checkpoint_id, pid, since_ns))


def restored_store(tmp_path: Path, entries: list[tuple[str, int | None, float | None]]) -> Store:
    store = Store(tmp_path / "store")
    for checkpoint_id, pid, exited_at in entries:
        meta = CheckpointMeta(id=checkpoint_id, pid=70, pids=[70], command="job --x",
                              comm="job", uid=0, user="root", cgroup="/a", cgroup_version=1,
                              rss_bytes=1, reason="test", criu_version="4.2", created=1.0)
        _images, fd = store.begin(meta)
        os.close(fd)
        store.commit(meta)
        if pid is not None:
            meta.state, meta.restored_pid, meta.restored_at = "restored", pid, 1000.0
            meta.exited_at = exited_at
            store.update(meta)
    return store


def test_rewatch_at_start_takes_only_the_restored_roots_still_running(tmp_path: Path) -> None:
    store = restored_store(tmp_path, [("running", 501, None), ("exited", 502, 1100.0),
                                      ("reused", 503, None), ("other-cmd", 504, None),
                                      ("gone", 505, None), ("waiting", None, None)])
    seen = {501: (999.5, "job --x"), 502: (999.5, "job --x"),
            503: (5000.0, "job --x"),  # the pid was taken again long after the restore
            504: (1000.0, "bash")}
    watch = Recorder()
    found = rewatch_restored(store, watch, identify=seen.get)  # type: ignore[arg-type]
    assert found == ["running"]
    assert watch.watched == [("running", 501, 77)] and watch.expected == [0]
    assert rewatch_restored(restored_store(tmp_path / "empty", []), watch,  # type: ignore[arg-type]
                            identify=seen.get) == []
