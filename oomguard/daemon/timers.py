"""The loop's timers: its timed work, each saying when it is next due (due_in) and doing its work
when it is (fire); the loop sleeps until the soonest and fires those due, in order.

Kernel notifications are the loop's first business (a crossing never waits behind these);
the timers are the rest: marks registered beside the loop coming in, polled guards (v2 without
memory.high, page cache over a threshold, the system rule's look at MemAvailable, sooner the
nearer its floor), the GPU watch, settling what actions left (limits to put back,
auto-restores, pruning) and the safety rescan. Each gets what it needs of the daemon as
callables (never the daemon itself), and owns its own schedule where it has one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from oomguard.daemon.guards import Guard

if TYPE_CHECKING:
    from oomguard.daemon.arming import LaterMarks
    from oomguard.daemon.gpuwatch import GpuWatch
    from oomguard.daemon.settling import Settler


class Timer(Protocol):
    def due_in(self, now: float) -> float | None:
        """Seconds until its work is due (0 or less: due now); None: nothing scheduled."""

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        """Do the work; `fired`: the guards examined on their own events this turn."""


class MarksIn:
    """The marks beyond the threshold, registered beside the loop once guards are armed:
    added as soon as they are in (their thread wakes the loop)."""

    def __init__(self, later_marks: LaterMarks, add: Callable[[], None]) -> None:
        self.later_marks = later_marks
        self.add = add

    def due_in(self, now: float) -> float | None:
        return 0.0 if self.later_marks.waiting() else None

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        self.add()


class GuardPolls:
    """Guards looked at on a schedule rather than on events: the system rule's, and the cgroup
    guards that have a time set (`scheduled`: the daemon's timetable, never all of them, so a
    turn of the loop costs the same whatever the number of guards)."""

    def __init__(self, scheduled: Callable[[], list[tuple[Guard, float]]],
                 examine: Callable[[Guard, float, str], None]) -> None:
        self.scheduled = scheduled
        self.examine = examine

    def due_in(self, now: float) -> float | None:
        due = [at for _guard, at in self.scheduled()]
        return min(due) - now if due else None

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        for guard, at in self.scheduled():
            if now >= at and not any(guard is f for f in fired):
                self.examine(guard, now, "poll")


class GpuPolls:
    """NVML read every gpu.poll_interval, while a rule has a GPU detection on (`watching`:
    gpu_threshold, oomguard.detect's GPU plug-ins)."""

    def __init__(self, watch: GpuWatch | None, watching: Callable[[], bool],
                 guards: Callable[[], Sequence[Guard]]) -> None:
        self.watch = watch
        self.watching = watching
        self.guards = guards

    def due_in(self, now: float) -> float | None:
        return self.watch.due_in(now) if self.watch is not None and self.watching() else None

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        if self.watch is not None:
            self.watch.tick(list(self.guards()))


class Settling:
    """What an action left (a lifted limit to put back, a store to prune, a checkpoint to
    bring back now that memory is free): at once when an action ends (`acted`, set from the
    Actor's threads), then while anything waits, every SETTLE_INTERVAL."""

    def __init__(self, settler: Settler, acted: threading.Event) -> None:
        self.settler = settler
        self.acted = acted

    def due_in(self, now: float) -> float | None:
        if self.acted.is_set():
            return 0.0
        at = self.settler.next_at
        return None if at is None else at - now

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        self.acted.clear()
        self.settler.settle()


class SafetyRescan:
    """Every rescan_interval: one stat(2) per guard for what inotify could have missed (then
    settling, as after an action). Owns its schedule: `next_at`, set again after each."""

    def __init__(self, rescan: Callable[[], None], settle: Callable[[], None],
                 interval: Callable[[], float], clock: Callable[[], float]) -> None:
        self.rescan = rescan
        self.settle = settle
        self.interval = interval
        self.clock = clock
        self.next_at = 0.0

    def schedule(self) -> None:
        """The next one, a whole interval from now."""
        self.next_at = self.clock() + self.interval()

    def due_in(self, now: float) -> float | None:
        return self.next_at - now

    def fire(self, now: float, fired: Collection[Guard]) -> None:
        self.rescan()
        self.settle()
        self.schedule()
