"""What the loop waits on for each guard: the owner of every fd registered with its epoll (the
guard and the kind of notification the fd brings), the timetable of the cgroup guards looked at
without an event (the loop's GuardPolls reads it), and the marks beyond the threshold that come
in from beside the loop, added where their guard still stands as it was armed."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from oomguard.cgroup import watch
from oomguard.daemon.arming import LaterMarks
from oomguard.daemon.guards import CgroupGuard, Guard


class Registrations:
    """Owns the owner of each fd the loop polls (`fd_owner`: fd -> (guard, kind)) and the
    timetable of the guards with a time set (`timed`: id -> the guard, each with a due_at).
    `epoll` is the loop's (select.epoll's register/unregister, or a test's fake)."""

    def __init__(self, epoll: Any, later_marks: LaterMarks, log: Any) -> None:
        self.epoll = epoll
        self.later_marks = later_marks
        self.log = log
        self.fd_owner: dict[int, tuple[Guard, str]] = {}
        self.timed: dict[int, CgroupGuard] = {}

    def register(self, guard: Guard) -> None:
        for fd, kind in guard.fds.items():
            self.epoll.register(fd, watch.EPOLL_MASK[kind])
            self.fd_owner[fd] = (guard, kind)

    def disarm(self, guard: Guard) -> None:
        if isinstance(guard, CgroupGuard):
            guard.generation += 1  # marks still coming in for it are stale
        for fd in guard.fds:
            with contextlib.suppress(OSError):
                self.epoll.unregister(fd)
            self.fd_owner.pop(fd, None)
            with contextlib.suppress(OSError):
                os.close(fd)
        guard.fds.clear()

    def set_due(self, guard: CgroupGuard, at: float | None) -> None:
        """When to look at `guard` without an event (None: only on events), in the
        timetable the loop's GuardPolls reads."""
        guard.due_at = at
        if at is None:
            self.timed.pop(id(guard), None)
        else:
            self.timed[id(guard)] = guard

    def add_later_marks(self) -> None:
        """The marks beyond the threshold that came in from beside the loop: added to each
        guard still armed as it was when they were asked for, closed for the others (armed
        again, gone, released)."""
        added = 0
        for marks in self.later_marks.take():
            guard = marks.guard
            if guard.generation != marks.generation or not guard.present:
                for fd in marks.fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                continue
            if marks.error is not None:
                self.log.warning("guard.marks_incomplete", cgroup=guard.name,
                                 error=marks.error, explanation="the threshold mark "
                                 "is armed; page cache above it is polled")
            for fd in marks.fds:
                guard.fds[fd] = watch.EVENTFD
                self.epoll.register(fd, watch.EPOLL_MASK[watch.EVENTFD])
                self.fd_owner[fd] = (guard, watch.EVENTFD)
            added += bool(marks.fds)
        if added:
            self.log.info("guard.marks_added", guards=added,
                          explanation="the marks beyond the threshold, which wake the daemon "
                          "as resident memory catches up with page cache")

    def forget(self) -> None:
        """A reload: every guard was let go (each fd closed and unregistered); the timetable
        goes with the old guards."""
        self.timed.clear()
