"""oomguard.sense.newcomers: births told by fork events, for the system rules' ranking (a fake
event source, and the real kernel connector where it is available)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from oomguard.sense.cnproc import ProcessExec, ProcessFork
from oomguard.sense.newcomers import Newcomers
from oomguard.sense.procevents import EventBatch, Subscriber


class FakeEvents:
    def __init__(self) -> None:
        self.queued: list[EventBatch] = []
        self.closed = False

    def fileno(self) -> int:
        return -1

    def read(self) -> EventBatch:
        return self.queued.pop(0) if self.queued else EventBatch()

    def close(self) -> None:
        self.closed = True


def test_births_since_a_time_threads_and_execs_aside() -> None:
    source = FakeEvents()
    newcomers = Newcomers(Subscriber(lambda: source))
    assert newcomers.since(0.0) == []  # not following: nothing known
    newcomers.follow(True)
    source.queued.append(EventBatch((
        ProcessFork(1, 1, 100, 100, timestamp_ns=5_000_000_000),
        ProcessFork(100, 100, 101, 100, timestamp_ns=6_000_000_000),  # a thread of 100
        ProcessExec(100, 100, 6_500_000_000),
        ProcessFork(100, 100, 102, 102, timestamp_ns=7_000_000_000))))
    assert newcomers.since(5.5) == [102]
    assert newcomers.since(1.0) == [100, 102]
    source.queued.append(EventBatch(lost=1))
    newcomers.since(0.0)
    assert newcomers.lost
    newcomers.follow(False)
    assert source.closed and newcomers.since(0.0) == []


def test_without_a_connector_nothing_is_followed() -> None:
    def refuse() -> FakeEvents:
        raise OSError(1, "Operation not permitted")

    newcomers = Newcomers(Subscriber(refuse))
    newcomers.follow(True)
    assert not newcomers.following and newcomers.since(0.0) == []


def test_the_kernel_tells_of_a_real_birth() -> None:
    newcomers = Newcomers()
    newcomers.follow(True)
    if not newcomers.following:
        pytest.skip(f"no process-event connector here: {newcomers.subscriber.last_error}")
    try:
        began = time.monotonic()
        child = subprocess.Popen(["sleep", "0.1"])
        child.wait()
        assert child.pid in newcomers.since(began)
        assert os.getpid() not in newcomers.since(began)
    finally:
        newcomers.close()
