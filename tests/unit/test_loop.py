"""oomguard.daemon.loop's event loop on a fake clock and a fake epoll (issue 17): how long it
sleeps (until the first piece of work is due: the safety rescan, systemd's watchdog, a system
rule's next look), that each piece runs when due and is scheduled again, that every turn
beats the heart, and that stop() from another thread ends run(). No cgroup is guarded; the
store is a scratch directory; no CRIU runs (nothing is ever dumped here)."""

from __future__ import annotations

import select
import threading
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.criu import Criu
from oomguard.act.freezer import SigstopFreezer
from oomguard.cgroup.mounts import CgroupLayout
from oomguard.config.loading import load_config_text
from oomguard.daemon.loop import Daemon
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.store.checkpoints import Store

NO_CGROUPS = CgroupLayout(memory_v1=None, unified=None, unified_controllers=())
GiB = 1 << 30
Memory = namedtuple("Memory", "total available")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeEpoll:
    """select.epoll's surface. poll() records the timeout it was given and "sleeps" it on the
    fake clock (or returns what a test queued, at once); with nothing queued and `stop_after`
    polls done, it stops the daemon the way another thread would."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.registered: dict[int, int] = {}
        self.timeouts: list[float] = []
        self.queued: list[list[tuple[int, int]]] = []
        self.on_poll: Any = None
        self.closed = False

    def register(self, fd: int, mask: int = select.EPOLLIN) -> None:
        self.registered[fd] = mask

    def unregister(self, fd: int) -> None:
        self.registered.pop(fd, None)

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        self.timeouts.append(timeout)
        if self.on_poll is not None:
            self.on_poll(len(self.timeouts))
        if self.queued:
            return self.queued.pop(0)
        self.clock.now += max(0.0, timeout)
        return []

    def close(self) -> None:
        self.closed = True


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append((event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.events if name == event]


def make_daemon(tmp_path: Path, rules: str = "", *, available: int = 12 * GiB,
                rescan: str = "30s", daemon_keys: str = "",
                ) -> tuple[Daemon, Clock, FakeEpoll, Log, dict[str, int]]:
    clock = Clock()
    polls: dict[str, FakeEpoll] = {}
    memory = {"available": available}
    text = f'[daemon]\nstore = "{tmp_path / "store"}"\nrescan_interval = "{rescan}"\nnice = 0\n' \
        + daemon_keys + rules
    config = load_config_text(text, str(tmp_path / "oomguard.toml"))
    checkpointer = Checkpointer(Criu(binary="/nonexistent/criu", version=(4, 2)),
                                Store(config.store), SigstopFreezer(), clock=clock)
    log = Log()

    def poller() -> FakeEpoll:
        polls["epoll"] = FakeEpoll(clock)
        return polls["epoll"]

    daemon = Daemon(config, checkpointer, NO_CGROUPS, log, clock=clock, poller=poller,
                    meminfo=lambda: Memory(16 * GiB, memory["available"]))
    return daemon, clock, polls["epoll"], log, memory


@pytest.fixture
def closing() -> Any:
    made: list[Daemon] = []
    yield made.append
    for daemon in made:
        daemon.close()


def test_it_sleeps_until_the_rescan_and_rescans_every_interval(tmp_path: Path,
                                                                closing: Any) -> None:
    daemon, clock, epoll, _log, _memory = make_daemon(tmp_path, rescan="30s")
    closing(daemon)
    daemon.arm()
    armed_at = clock.now
    for _ in range(3):
        daemon.tick()
    assert epoll.timeouts == pytest.approx([30.0, 30.0, 30.0])
    assert clock.now == pytest.approx(armed_at + 90.0)
    assert daemon.rescan.next_at == pytest.approx(clock.now + 30.0)  # scheduled again each time


def test_the_watchdog_interval_caps_the_sleep_and_each_turn_beats(tmp_path: Path,
                                                                   closing: Any) -> None:
    daemon, _clock, epoll, _log, _memory = make_daemon(tmp_path, rescan="1h")
    closing(daemon)
    beats: list[float] = []
    daemon.max_sleep = 5.0  # systemd's WatchdogSec/2
    daemon.heartbeat = lambda: beats.append(1)
    daemon.heartbeat_due = lambda now: 2.0  # the next STATUS=/metrics write, sooner still
    daemon.arm()
    for _ in range(4):
        daemon.tick()
    assert epoll.timeouts == pytest.approx([2.0] * 4)
    assert len(beats) == 4


def test_a_system_rule_is_looked_at_sooner_the_nearer_the_floor(tmp_path: Path,
                                                                 closing: Any) -> None:
    """earlyoom's schedule: at 6 GB/s of growth, half the distance to the floor in time;
    never longer than a second. The loop sleeps exactly until that look."""
    rule = '[[guard]]\nsystem = true\nmin_available = "256M"\n'
    daemon, _clock, epoll, log, memory = make_daemon(tmp_path, rule, rescan="1h",
                                                    available=(256 << 20) + 10 * 10**9)
    closing(daemon)
    daemon.arm()
    daemon.tick()  # far from the floor: looked at once a second
    memory["available"] = (256 << 20) + 3 * 10**9  # 3 GB above it: 0.5 s
    daemon.tick()
    daemon.tick()
    assert epoll.timeouts[1:] == pytest.approx([1.0, 0.5]), epoll.timeouts
    assert not log.named("threshold.crossed")


def test_stop_from_another_thread_ends_run(tmp_path: Path, closing: Any) -> None:
    daemon, _clock, epoll, log, _memory = make_daemon(tmp_path, rescan="1h")
    closing(daemon)
    daemon.arm()

    def on_poll(count: int) -> None:
        if count == 3:  # the third wait: a signal handler (or the control socket) says stop
            stopper = threading.Thread(target=daemon.stop)
            stopper.start()
            stopper.join()
            epoll.queued.append([(daemon._wakeup.fileno(), select.EPOLLIN)])

    epoll.on_poll = on_poll
    daemon.run()  # returns: the wake-up was read and the loop saw _stopping
    assert len(epoll.timeouts) == 3
    assert not [e for e, _f in log.events if e.endswith("failed") or e.endswith("error")]


def test_a_reload_asked_for_is_done_by_the_loop_not_the_signal_handler(
        tmp_path: Path, closing: Any) -> None:
    daemon, _clock, epoll, log, _memory = make_daemon(tmp_path, rescan="1h")
    closing(daemon)
    daemon.arm()
    daemon.request_reload()  # what SIGHUP's handler does: a flag and a wake-up, nothing else
    assert not log.named("config.reload_ignored") and not log.named("config.reloaded")
    epoll.queued.append([(daemon._wakeup.fileno(), select.EPOLLIN)])
    daemon.tick()
    # The config came from a file that is not there (load_config_text): the loop says so.
    assert log.named("config.reload_ignored")


def test_after_arming_runs_once_every_guard_is_built_and_after_a_reload(
        tmp_path: Path, closing: Any) -> None:
    rule = '[[guard]]\nsystem = true\nmin_available = "256M"\n'
    daemon, _clock, _epoll, _log, _memory = make_daemon(tmp_path, rule, rescan="1h")
    closing(daemon)
    seen: list[int] = []
    daemon.after_arming = lambda: seen.append(daemon.armed_count())
    daemon.arm()
    assert seen == [1]  # the system rule's guard, armed before the heap is settled
    source = tmp_path / "oomguard.toml"
    source.write_text(f'[daemon]\nstore = "{tmp_path / "store"}"\nnice = 0\n')
    daemon.reload()  # the new file has no rule: nothing armed, settled again
    assert seen == [1, 0]


class EveryFewSeconds:
    """A trigger of the test's own: due every `period` seconds of the fake clock."""

    def __init__(self, clock: Clock, period: float) -> None:
        self.clock = clock
        self.period = period
        self.next_at = clock.now + period
        self.fired_at: list[float] = []

    def due_in(self, now: float) -> float | None:
        return self.next_at - now

    def fire(self, now: float, fired: Any) -> None:
        self.fired_at.append(now)
        self.next_at = now + self.period


def test_the_loop_sleeps_until_the_soonest_timer_and_fires_only_those_due(
        tmp_path: Path, closing: Any) -> None:
    daemon, clock, epoll, _log, _memory = make_daemon(tmp_path, rescan="1h")
    closing(daemon)
    daemon.arm()
    start = clock.now
    fast, slow = EveryFewSeconds(clock, 7.0), EveryFewSeconds(clock, 20.0)
    daemon.timers += [fast, slow]
    for _ in range(4):
        daemon.tick()
    assert epoll.timeouts == pytest.approx([7.0, 7.0, 6.0, 1.0])  # 7, 14, 20, 21
    assert [t - start for t in fast.fired_at] == pytest.approx([7.0, 14.0, 21.0])
    assert [t - start for t in slow.fired_at] == pytest.approx([20.0])


def test_every_timer_of_the_daemon_says_when_it_is_due(tmp_path: Path, closing: Any) -> None:
    from oomguard.daemon.timers import GpuPolls, GuardPolls, MarksIn, SafetyRescan, Settling

    daemon, clock, _epoll, _log, _memory = make_daemon(tmp_path, rescan="30s")
    closing(daemon)
    daemon.arm()
    kinds = [type(t) for t in daemon.timers]
    assert kinds == [MarksIn, GuardPolls, GpuPolls, Settling, SafetyRescan]
    marks, polls, gpu, settling, rescan = daemon.timers
    assert marks.due_in(clock.now) is None  # no marks waiting to be added
    assert polls.due_in(clock.now) is None  # no guard polled
    assert gpu.due_in(clock.now) is None  # no GPU here
    assert settling.due_in(clock.now) is None  # nothing waits to be settled
    assert rescan.due_in(clock.now) == pytest.approx(30.0)
    daemon.action_done("x")  # an action ended (from an Actor thread): settled at once
    assert settling.due_in(clock.now) == 0.0


def test_guard_polls_read_only_the_timetable(tmp_path: Path, closing: Any) -> None:
    """A cgroup guard is polled when it has a time set (set_due) and is present, not by a
    scan of every guard; taken off the timetable, it is no longer due."""
    from types import SimpleNamespace

    from oomguard.config.loading import GuardConfig
    from oomguard.daemon.guards import CgroupGuard
    from oomguard.daemon.timers import GuardPolls

    daemon, clock, _epoll, _log, _memory = make_daemon(tmp_path, rescan="1h")
    closing(daemon)
    daemon.arm()
    polls = next(t for t in daemon.timers if isinstance(t, GuardPolls))
    quiet, timed = (CgroupGuard(spec=GuardConfig(cgroups=("x",)),
                                cgroup=SimpleNamespace(path=Path(f"/x/{n}")))  # type: ignore[arg-type]
                    for n in ("quiet", "timed"))
    daemon.guards += [quiet, timed]
    examined: list[str] = []
    daemon._examine = lambda guard, now, source: examined.append(guard.name)  # type: ignore[method-assign]
    assert polls.due_in(clock.now) is None
    daemon.registrations.set_due(timed, clock.now + 5)
    assert polls.due_in(clock.now) == pytest.approx(5.0)
    polls.fire(clock.now, [])
    assert examined == []
    polls.fire(clock.now + 5, [timed])  # examined on its own event this turn: not again
    assert examined == []
    polls.fire(clock.now + 5, [])
    assert examined == ["/x/timed"]
    timed.present = False
    assert polls.due_in(clock.now) is None
    timed.present = True
    daemon.registrations.set_due(timed, None)
    assert polls.due_in(clock.now) is None and daemon.registrations.timed == {}


def test_reclaim_wakes_are_counted_until_a_look_is_due(tmp_path: Path, closing: Any) -> None:
    import os
    from types import SimpleNamespace

    from oomguard.cgroup.watch import RECLAIM
    from oomguard.config.schema import GuardConfig
    from oomguard.daemon.guards import CgroupGuard
    from oomguard.policy.guardlook import GuardHistory

    daemon, _clock, epoll, _log, _memory = make_daemon(tmp_path)
    closing(daemon)
    guard = CgroupGuard(spec=GuardConfig(cgroups=("/x",)),
                        cgroup=SimpleNamespace(path=Path("/x")))  # type: ignore[arg-type]
    # 40 MiB of reclaim before the threshold can be reached
    guard.history = GuardHistory(reclaim_room=40 * (1 << 20))
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    daemon.registrations.fd_owner[fd] = (guard, RECLAIM)
    looks: list[str] = []
    daemon._examine = lambda g, woke, source: looks.append(source)  # type: ignore[method-assign]
    try:
        for windows in (4, 4, 1):  # 2 MiB each: looked at once 9 + 1 windows could be 20 MiB
            os.eventfd_write(fd, windows)
            epoll.queued.append([(fd, select.EPOLLIN)])
            daemon.tick()
            with pytest.raises(BlockingIOError):
                os.read(fd, 8)  # the count was read (consumed) by the turn
        assert looks == ["event"]
        assert guard.history.reclaim_events == 9  # reset by the look itself (_examine_cgroup)
    finally:
        os.close(fd)
