"""Connection limits, the rejected-request log throttle, nested frames, and finding the
daemon's own descendants among candidates without reading every thread's children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from oomguard.control.limits import ConnectionLimiter, LogThrottle
from oomguard.control.protocol import ProtocolError, decode_call
from oomguard.sense.procfs import ProcReader


def test_limiter_bounds_each_uid_and_the_total() -> None:
    limiter = ConnectionLimiter(total=5, per_uid=2)
    assert limiter.admit(1000) is None and limiter.admit(1000) is None
    assert "uid 1000" in str(limiter.admit(1000))
    assert limiter.admit(1001) is None and limiter.admit(1001) is None
    assert limiter.admit(0) is None
    assert "5 connections" in str(limiter.admit(1002))
    limiter.release(1000)
    assert limiter.admit(1002) is None
    assert limiter.open_count() == 5


def test_throttle_allows_a_burst_then_counts_what_it_suppressed() -> None:
    now = [0.0]
    throttle = LogThrottle(burst=3, window=10.0, clock=lambda: now[0])
    assert [throttle.allow("k")[0] for _ in range(5)] == [True, True, True, False, False]
    assert throttle.allow("other") == (True, 0)
    now[0] = 10.5
    assert throttle.allow("k") == (True, 2)
    assert throttle.allow("k") == (True, 0)


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
