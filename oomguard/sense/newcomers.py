"""Processes started since a given time, told by the kernel's fork events: what a system
rule's ranking of processes (sense/ranking.py) has not seen yet. Subscribed only while memory is
low (the system rule says when): a busy machine forks thousands of times a second, and nobody
needs to hear of it while memory is plentiful."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from oomguard.sense.cnproc import FORKS, ProcessFork
from oomguard.sense.procevents import EventSource, Subscriber

KEPT = 8192  # the newest births remembered (older ones are in the next ranking anyway)


class Newcomers:
    """follow(True) subscribes (follow(False) lets go); since(t) is every process born at or
    after t (the clock's seconds) that is still remembered. Thread-safe: the loop follows, an
    action's thread asks."""

    def __init__(self, subscriber: Subscriber | None = None, *,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.subscriber = subscriber or Subscriber(kinds=FORKS)
        self.clock_ns = clock_ns
        self._events: EventSource | None = None
        self._born: deque[tuple[int, int]] = deque(maxlen=KEPT)  # (timestamp_ns, pid)
        self._lock = threading.Lock()
        self.lost = False  # events were lost (a full socket buffer): newcomers may be missing

    @property
    def following(self) -> bool:
        return self._events is not None

    def follow(self, wanted: bool) -> None:
        with self._lock:
            if wanted and self._events is None:
                self._events = self.subscriber.open()  # None where the connector is unavailable
                self._born.clear()
                self.lost = False
            elif not wanted and self._events is not None:
                self._events.close()
                self._events = None
                self._born.clear()

    def _drain(self) -> None:
        """(With the lock held.)"""
        if self._events is None:
            return
        batch = self._events.read()
        self.lost = self.lost or batch.lost > 0
        for event in batch.events:
            if isinstance(event, ProcessFork) and event.new_process:
                self._born.append((event.timestamp_ns or self.clock_ns(), event.child_tgid))

    def since(self, when: float) -> list[int]:
        """Processes born at or after `when` (time.monotonic seconds), oldest first."""
        floor = int(when * 1e9)
        with self._lock:
            self._drain()
            return list(dict.fromkeys(pid for stamp, pid in self._born if stamp >= floor))

    def close(self) -> None:
        self.follow(False)
