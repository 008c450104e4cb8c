"""Connection limits, the rejected-request log throttle, nested frames, and finding the
daemon's own descendants among candidates without reading every thread's children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from oomguard.control.limits import CallRate, CallSummary, ConnectionLimiter, LogThrottle
from oomguard.control.protocol import ProtocolError, decode_call
from oomguard.sense.procfs import ProcReader


def test_limiter_bounds_each_uid_and_the_total() -> None:
    limiter = ConnectionLimiter(total=5, per_uid=2, reserve=0)
    assert limiter.admit(1000) is None and limiter.admit(1000) is None
    assert "uid 1000" in str(limiter.admit(1000))
    assert limiter.admit(1001) is None and limiter.admit(1001) is None
    assert limiter.admit(0) is None
    assert "5 connections" in str(limiter.admit(1002))
    limiter.release(1000)
    assert limiter.admit(1002) is None
    assert limiter.open_count() == 5


def test_users_filling_their_slots_leave_the_reserve_to_root() -> None:
    limiter = ConnectionLimiter(total=6, per_uid=2, reserve=2)
    assert [limiter.admit(uid) for uid in (1000, 1000, 1001, 1001)] == [None] * 4
    refused = limiter.admit(1002)
    assert refused is not None and "kept for root" in refused
    assert limiter.admit(0) is None and limiter.admit(0) is None
    assert "6 connections" in str(limiter.admit(0))
    limiter.release(0)
    assert "kept for root" in str(limiter.admit(1002))  # root's slot freed is still root's
    limiter.release(1000)
    assert limiter.admit(1002) is None


def test_call_rate_lets_a_burst_through_then_paces_each_uid() -> None:
    now = [0.0]
    rate = CallRate(rate=10.0, burst=3, clock=lambda: now[0])
    assert [rate.delay(1000) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rate.delay(1000) == pytest.approx(0.1)
    assert rate.delay(1000) == pytest.approx(0.2)  # queued behind the one before
    assert rate.delay(1001) == 0.0  # another uid has its own bucket
    now[0] = 1.0  # refilled (to the burst at most)
    assert [rate.delay(1000) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rate.delay(1000) > 0


def test_throttle_allows_a_burst_then_counts_what_it_suppressed() -> None:
    now = [0.0]
    throttle = LogThrottle(burst=3, window=10.0, clock=lambda: now[0])
    assert [throttle.allow("k")[0] for _ in range(5)] == [True, True, True, False, False]
    assert throttle.allow("other") == (True, 0)
    now[0] = 10.5
    assert throttle.allow("k") == (True, 2)
    assert throttle.allow("k") == (True, 0)


def test_routine_calls_make_one_summary_a_window_with_every_call_counted() -> None:
    now = [0.0]
    summary = CallSummary(window=60.0, clock=lambda: now[0])
    for second in range(600):  # ten calls a second for a minute, from two uids
        now[0] = second / 10
        assert summary.add(1000 if second % 3 else 0, "Status") is None
    now[0] = 60.0
    line = summary.add(1000, "List")
    assert line is not None
    assert line["total"] == 601 and line["window_s"] == 60.0
    assert line["calls"] == {"0": {"Status": 200}, "1000": {"List": 1, "Status": 400}}
    now[0] = 61.0
    assert summary.add(1000, "List") is None  # the next window starts at the summary


def test_deeply_nested_frame_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode_call(b"[" * 100_000 + b"]" * 100_000)


def test_descended_from_finds_children_and_grandchildren_only() -> None:
    reader = ProcReader()
    grandchild = 0
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess,sys,time; p=subprocess.Popen(['sleep','30']);"
                              "print(p.pid, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        candidates = reader.processes([child.pid, grandchild, 1, os.getppid()])
        assert reader.descended_from(os.getpid(), candidates) == {child.pid, grandchild}
        assert reader.descended_from(child.pid, candidates) == {child.pid, grandchild}
    finally:
        for pid in (grandchild, child.pid):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        child.wait()
