"""oomguard.daemon.parkwatch: a task parked at a v1 limit is handed to the kernel's OOM killer after
park_deadline (fake clock, fake memory.oom_control), and parked again once none waits."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import pytest

from oomguard.daemon.parkwatch import ParkWatchdog, park_reason
from oomguard.model.errors import CgroupGone


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    info = warning = error = _record

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


class FakeCgroup:
    """memory.oom_control as the kernel shows it; writes and reads recorded; its OOM
    notification a real eventfd that `notify()` signals, as the kernel does."""

    def __init__(self) -> None:
        self.under_oom = 0
        self.disabled = True
        self.writes: list[bool] = []
        self.reads = 0
        self.gone = False
        self.notifications: list[int] = []

    def oom_control(self) -> dict[str, int]:
        self.reads += 1
        if self.gone:
            raise CgroupGone("gone")
        return {"oom_kill_disable": int(self.disabled), "under_oom": self.under_oom,
                "oom_kill": 0}

    def register_oom(self) -> int:
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.notifications.append(fd)
        return fd

    def notify(self) -> None:
        for fd in self.notifications:
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)

    def set_oom_kill_disable(self, disabled: bool) -> None:
        self.disabled = disabled
        self.writes.append(disabled)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def rig() -> tuple[ParkWatchdog, FakeCgroup, Clock, Log]:
    clock, log, cgroup = Clock(), Log(), FakeCgroup()
    watchdog = ParkWatchdog(log, lambda name, waited: f"stuck: {name} {waited:.0f}", clock=clock)
    watchdog.watch("/cg", cgroup, 30.0)
    return watchdog, cgroup, clock, log


def test_a_park_shorter_than_the_deadline_is_left_alone(rig: Any) -> None:
    watchdog, cgroup, clock, log = rig
    cgroup.under_oom = 1
    for _ in range(30):  # 29 s parked
        watchdog.check()
        clock.now += 1
    assert clock.now - 1 - 1000 == 29
    cgroup.under_oom = 0  # oomguard acted
    watchdog.check()
    cgroup.under_oom = 1  # a new park starts a new count
    for _ in range(29):
        clock.now += 1
        watchdog.check()
    assert cgroup.writes == [] and log.events == []


def test_a_park_reaching_the_deadline_is_released_with_the_reason(rig: Any) -> None:
    watchdog, cgroup, clock, log = rig
    cgroup.under_oom = 1
    watchdog.check()
    clock.now += 29.9
    watchdog.check()
    assert cgroup.writes == []
    clock.now += 0.1
    watchdog.check()
    assert cgroup.writes == [False] and not cgroup.disabled
    (name, fields), = log.events
    assert name == "oom.released"
    assert fields["cgroup"] == "/cg" and fields["reason"] == "stuck: /cg 30"
    assert fields["parked_seconds"] == 30.0 and fields["park_deadline"] == 30.0
    clock.now += 5  # the kernel has not settled it yet: released once, not again
    watchdog.check()
    assert cgroup.writes == [False] and log.names() == ["oom.released"]


def test_released_park_is_armed_again_once_no_task_waits(rig: Any) -> None:
    watchdog, cgroup, clock, log = rig
    cgroup.under_oom = 1
    watchdog.check()
    clock.now += 31
    watchdog.check()
    cgroup.under_oom = 0  # the OOM killer acted
    clock.now += 1
    watchdog.check()
    assert cgroup.writes == [False, True] and cgroup.disabled
    assert log.names() == ["oom.released", "oom.rearmed"]
    cgroup.under_oom = 1  # the next park gets the whole deadline again
    clock.now += 1
    watchdog.check()
    clock.now += 29
    watchdog.check()
    assert cgroup.writes == [False, True]


def test_unwatched_cgroup_is_never_written(rig: Any) -> None:
    watchdog, cgroup, clock, _log = rig
    cgroup.under_oom = 1
    watchdog.check()
    watchdog.unwatch("/cg")
    clock.now += 100
    watchdog.check()
    assert cgroup.writes == [] and watchdog.watching() == []


def test_vanished_cgroup_is_dropped_and_others_still_watched(rig: Any) -> None:
    watchdog, cgroup, clock, log = rig
    other = FakeCgroup()
    watchdog.watch("/other", other, 5.0)
    cgroup.gone = True
    other.under_oom = 1
    watchdog.check()
    clock.now += 5
    watchdog.check()
    assert watchdog.watching() == ["/other"]
    assert other.writes == [False] and log.names() == ["oom.released"]


def test_a_failing_read_is_logged_and_retried() -> None:
    class Broken(FakeCgroup):
        def oom_control(self) -> dict[str, int]:
            raise PermissionError("EACCES")

    log = Log()
    watchdog = ParkWatchdog(log, lambda name, waited: "", clock=Clock())
    watchdog.watch("/cg", Broken(), 30.0)
    watchdog.check()
    assert log.names() == ["oom.watchdog_failed"] and watchdog.watching() == ["/cg"]


def releasing(released: threading.Event) -> Any:
    """A reason() that says the watchdog released a park."""
    def reason(name: str, waited: float) -> str:
        released.set()
        return "loop wedged"
    return reason


def test_the_thread_releases_without_the_event_loop() -> None:
    """The real thread (a short interval, the real clock): nothing but the watchdog runs."""
    log, cgroup = Log(), FakeCgroup()
    cgroup.under_oom = 1
    released = threading.Event()
    watchdog = ParkWatchdog(log, releasing(released), interval=0.01)
    watchdog.watch("/cg", cgroup, 0.05)
    watchdog.start()
    try:
        assert released.wait(10)
    finally:
        watchdog.stop()
    assert cgroup.writes[:1] == [False]
    assert log.names()[:1] == ["oom.released"]


@pytest.mark.parametrize(("idle", "acting", "reason"), [
    (7.0, False, "the daemon's event loop has not turned for 7s"),
    (7.0, True, "the daemon's event loop has not turned for 7s"),
    (1.0, True, "the action on this cgroup (a dump, a grace period) has not ended"),
    (6.0, False, "no action freed memory here: no victim could be checkpointed, and no action "
                 "of the rule kills"),
])
def test_park_reason(idle: float, acting: bool, reason: str) -> None:
    assert park_reason(idle, 6.0, acting) == reason


def test_the_thread_reads_only_cgroups_whose_oom_notification_fired() -> None:
    """A thousand quiet cgroups cost the watchdog nothing: it sleeps on their OOM
    notifications, reads a cgroup once it fired, and follows it until its park is over."""
    log = Log()
    quiet, parked = FakeCgroup(), FakeCgroup()
    released = threading.Event()
    watchdog = ParkWatchdog(log, releasing(released), interval=0.01)
    watchdog.watch("/quiet", quiet, 0.05)
    watchdog.watch("/parked", parked, 0.05)
    watchdog.start()
    try:
        time.sleep(0.3)  # 30 intervals: each read once (at watch), never again
        assert quiet.reads <= 2 and parked.reads <= 2
        parked.under_oom = 1
        parked.notify()
        assert released.wait(10)
        assert parked.writes[:1] == [False]
        parked.under_oom = 0  # the OOM killer acted: parked again, then left alone
        deadline = time.monotonic() + 10
        while parked.writes[-1:] != [True] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert parked.writes == [False, True]
        settled = parked.reads
        time.sleep(0.3)
        assert parked.reads <= settled + 1
    finally:
        watchdog.stop()
    assert quiet.reads <= 2 and quiet.writes == []
    assert log.names()[:2] == ["oom.released", "oom.rearmed"]
