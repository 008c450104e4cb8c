"""The loop's timed work as triggers: each says when it is next due (due_in) and does its
work when it is (fire); the loop sleeps until the soonest and fires those due, in order.

Kernel notifications are the loop's first business (a crossing never waits behind these);
the triggers are the rest: marks registered beside the loop coming in, polled guards (v2
without memory.high, page cache over a threshold, the system rule's look at MemAvailable,
sooner the nearer its floor), the GPU watch, settling what actions left (limits to put back,
auto-restores, pruning) and the safety rescan.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from oomguard.daemon.guards import Guard

if TYPE_CHECKING:
    from oomguard.daemon.loop import Daemon


class Trigger(Protocol):
    def due_in(self, now: float) -> float | None:
        """Seconds until its work is due (0 or less: due now); None: nothing scheduled."""

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        """Do the work; `fired`: the guards examined on their own events this turn."""


class MarksIn:
    """The marks beyond the threshold, registered beside the loop once guards are armed:
    added as soon as they are in (their thread wakes the loop)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def due_in(self, now: float) -> float | None:
        return 0.0 if self.daemon.later_marks.waiting() else None

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        self.daemon._add_later_marks()


class GuardPolls:
    """Guards looked at on a schedule rather than on events: the system rule's, and the cgroup
    guards that have a time set (the daemon's timetable, `_timed`: never all of them, so a
    turn of the loop costs the same whatever the number of guards)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _scheduled(self) -> list[tuple[Guard, float]]:
        daemon = self.daemon
        found: list[tuple[Guard, float]] = [(g, daemon._next_system_poll)
                                            for g in daemon._system_guards]
        found += [(g, g.due_at) for g in daemon._timed.values()
                  if g.present and g.due_at is not None]
        return found

    def due_in(self, now: float) -> float | None:
        due = [at for _guard, at in self._scheduled()]
        return min(due) - now if due else None

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        for guard, at in self._scheduled():
            if now >= at and not any(guard is f for f in fired):
                self.daemon._examine(guard, now, "poll")


class GpuPolls:
    """NVML read every gpu.poll_interval, while a rule has a gpu_threshold."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def due_in(self, now: float) -> float | None:
        watch = self.daemon.gpu_watch
        return watch.due_in(now) if watch is not None and self.daemon._gpu_watching else None

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        if self.daemon.gpu_watch is not None:
            self.daemon.gpu_watch.tick(self.daemon.guards)


class Settling:
    """What an action left (a lifted limit to put back, a store to prune, a checkpoint to
    bring back now that memory is free): at once when an action ends, then while anything
    waits, every SETTLE_INTERVAL."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def due_in(self, now: float) -> float | None:
        if self.daemon._acted.is_set():
            return 0.0
        at = self.daemon.settler.next_at
        return None if at is None else at - now

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        self.daemon._acted.clear()
        self.daemon.settler.settle()


class SafetyRescan:
    """Every rescan_interval: one stat(2) per guard for what inotify could have missed."""

    def __init__(self, daemon: Daemon, clock: Callable[[], float]) -> None:
        self.daemon = daemon
        self.clock = clock

    def due_in(self, now: float) -> float | None:
        return self.daemon._next_rescan - now

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        daemon = self.daemon
        daemon._safety_rescan()
        daemon.settler.settle()
        daemon._next_rescan = self.clock() + daemon.config.rescan_interval


def daemon_triggers(daemon: Daemon, clock: Callable[[], float]) -> list[Trigger]:
    """In the order they fire within a turn."""
    return [MarksIn(daemon), GuardPolls(daemon), GpuPolls(daemon), Settling(daemon),
            SafetyRescan(daemon, clock)]
