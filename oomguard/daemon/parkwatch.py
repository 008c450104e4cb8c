"""The park watchdog: a thread, independent of the event loop, that hands a v1 cgroup back to
the kernel's OOM killer when its tasks have waited at the limit (oom_kill_disable) for longer
than the rule's park_deadline, so that no task stays parked forever.

It holds an OOM notification of its own for each watched cgroup and sleeps on them: it reads
memory.oom_control only of cgroups whose notification fired (and until their park is over),
so a thousand quiet cgroups cost it nothing."""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from oomguard.model.errors import CgroupGone
from oomguard.model.wakepipe import WakePipe

# How often the watchdog reads memory.oom_control of each parked-capable cgroup. A park ends
# within park_deadline + this.
CHECK_INTERVAL = 1.0


def park_reason(loop_idle: float, loop_stale_after: float, stuck_acting: bool) -> str:
    """Why tasks waited at a cgroup's limit without oomguard ending it (for `oom.released`).
    `stuck_acting`: one action on the cgroup has run through the whole wait (actions that
    start and end meanwhile found nothing to do)."""
    if loop_idle > loop_stale_after:
        return f"the daemon's event loop has not turned for {loop_idle:.0f}s"
    if stuck_acting:
        return "the action on this cgroup (a dump, a grace period) has not ended"
    return ("no action freed memory here: no victim could be checkpointed, and no action of "
            "the rule kills")


class ParkableCgroup(Protocol):
    def oom_control(self) -> dict[str, int]: ...

    def set_oom_kill_disable(self, disabled: bool) -> None: ...

    def register_oom(self) -> int: ...


@dataclass
class _Watched:
    cgroup: ParkableCgroup
    deadline: float
    parked_since: float | None = None
    released: bool = False  # oom_kill_disable is 0 now, by the watchdog's hand
    oom_fd: int | None = None  # its own OOM notification (None: it could not: read every round)
    suspect: bool = True  # to be read at the next round (its notification fired, or new)

    @property
    def followed(self) -> bool:
        """Read at every round: parked, released, just notified, or without a notification."""
        return self.suspect or self.parked_since is not None or self.released \
            or self.oom_fd is None


class ParkWatchdog:
    """`watch` a cgroup once oomguard has set its oom_kill_disable, `unwatch` it before putting
    the original value back. Every CHECK_INTERVAL, a cgroup that has stayed `under_oom` for
    its deadline gets oom_kill_disable = 0 (the kernel's OOM killer acts on it as it would
    without oomguard; `oom.released`, with `reason(name, waited)` saying why oomguard did not
    act in those `waited` seconds), and
    gets it back (`oom.rearmed`) once no task waits there any more."""

    def __init__(self, log: Any, reason: Callable[[str, float], str], *,
                 clock: Callable[[], float] = time.monotonic,
                 interval: float = CHECK_INTERVAL) -> None:
        self.log = log
        self.reason = reason
        self.clock = clock
        self.interval = interval
        self._watched: dict[str, _Watched] = {}
        self._by_fd: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._epoll = select.epoll()
        self._wakeup = WakePipe()
        self._epoll.register(self._wakeup.fileno(), select.EPOLLIN)

    def watch(self, name: str, cgroup: ParkableCgroup, deadline: float) -> None:
        entry = _Watched(cgroup, deadline)
        with contextlib.suppress(OSError, CgroupGone):
            entry.oom_fd = cgroup.register_oom()
        with self._lock:
            self._forget(name)
            self._watched[name] = entry
            if entry.oom_fd is not None:
                self._by_fd[entry.oom_fd] = name
                self._epoll.register(entry.oom_fd, select.EPOLLIN)
        self._wakeup.wake()  # read it once: tasks may be waiting already

    def unwatch(self, name: str) -> None:
        """After this returns the watchdog writes nothing more to that cgroup."""
        with self._lock:
            self._forget(name)

    def _forget(self, name: str) -> None:
        """(With the lock held.)"""
        entry = self._watched.pop(name, None)
        if entry is not None and entry.oom_fd is not None:
            self._by_fd.pop(entry.oom_fd, None)
            with contextlib.suppress(OSError):
                self._epoll.unregister(entry.oom_fd)
            with contextlib.suppress(OSError):
                os.close(entry.oom_fd)

    def watching(self) -> list[str]:
        with self._lock:
            return sorted(self._watched)

    def check(self) -> None:
        """One round over every watched cgroup."""
        self._round(everyone=True)

    def _round(self, everyone: bool = False) -> bool:
        """Read the cgroups that need it (all, with `everyone`); True while any still does."""
        with self._lock:
            for name, entry in list(self._watched.items()):
                if not (everyone or entry.followed):
                    continue
                entry.suspect = False
                try:
                    self._check_one(name, entry)
                except CgroupGone:
                    self._forget(name)
                except OSError as exc:
                    self.log.warning("oom.watchdog_failed", cgroup=name, error=str(exc))
            return any(entry.followed for entry in self._watched.values())

    def _check_one(self, name: str, entry: _Watched) -> None:
        now = self.clock()
        parked = bool(entry.cgroup.oom_control().get("under_oom", 0))
        if not parked:
            entry.parked_since = None
            if entry.released:
                entry.cgroup.set_oom_kill_disable(True)
                entry.released = False
                self.log.info("oom.rearmed", cgroup=name,
                              explanation="no task waits at the limit any more: tasks that "
                              "reach it are parked for oomguard again")
            return
        if entry.parked_since is None:
            entry.parked_since = now
        waited = now - entry.parked_since
        if entry.released or waited < entry.deadline:
            return
        entry.cgroup.set_oom_kill_disable(False)
        entry.released = True
        self.log.error("oom.released", cgroup=name, parked_seconds=round(waited, 1),
                       park_deadline=entry.deadline, reason=self.reason(name, waited),
                       explanation="tasks waited at the memory limit past park_deadline: "
                       "oom_kill_disable is 0 and the kernel's OOM killer acts as it would "
                       "without oomguard")

    # -- the thread ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="oomguard-park-watchdog",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        following = True  # read everything once at the start
        while not self._stop.is_set():
            ready = self._epoll.poll(self.interval if following else -1)
            with self._lock:
                for fd, _mask in ready:
                    if fd == self._wakeup.fileno():
                        self._wakeup.drain()
                        continue
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(fd, 8)
                    name = self._by_fd.get(fd)
                    if name is not None:
                        self._watched[name].suspect = True
            if self._stop.is_set():
                return
            try:
                following = self._round()
            except Exception as exc:  # the watchdog must outlive any one bad round
                self.log.error("oom.watchdog_failed", error=repr(exc))
                following = True

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.wake()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            for name in list(self._watched):
                self._forget(name)
