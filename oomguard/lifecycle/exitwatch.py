"""Watching restored trees until their root exits, to record when and with what status.

CRIU restores detached: the daemon is not the parent of a restored root, so waitpid cannot
tell. A pidfd (pidfd_open + poll) tells *when* the root exits; the kernel's process-event
connector (oomguard.sense.procevents) tells *how* (exit code or signal). The connector is
listened to only while a restore is under way or a restored tree is watched; where it is
unavailable, or lost the event (its buffer overflowed: ENOBUFS), the status is recorded as
unknown, and `why_no_status` / `events_lost` say why.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from oomguard.model.errors import StoreError
from oomguard.model.wakepipe import WakePipe
from oomguard.sense.cnproc import EXITS, ProcessExit
from oomguard.sense.procevents import EventSource, ProcEvents, unavailable
from oomguard.store.checkpoints import Store

STATUS_WAIT = 1.0  # after the pidfd says "exited", how long the connector's event may take
RECENT_EXITS = 4096  # exits remembered for roots that end before they are watched
RESTORE_SLACK = 600.0  # a restored root starts at most this long before restored_at is set

ExitCallback = Callable[[str, int, float, ProcessExit | None], None]


def exit_fields(status: ProcessExit | None) -> dict[str, Any]:
    """meta.json's fields for an exit: exit_status (the code) or exit_signal (its name);
    neither when the status is unknown."""
    if status is None:
        return {"exit_status": None, "exit_signal": None}
    if status.signal is not None:
        try:
            name = signal.Signals(status.signal).name
        except ValueError:
            name = str(status.signal)
        return {"exit_status": None, "exit_signal": name}
    return {"exit_status": status.exit_code, "exit_signal": None}


def describe_exit(status: ProcessExit | None) -> str:
    fields = exit_fields(status)
    if fields["exit_signal"] is not None:
        return f"killed by {fields['exit_signal']}"
    if fields["exit_status"] is not None:
        return f"exited with status {fields['exit_status']}"
    return "unknown"


def record_exit(store: Store, checkpoint_id: str, pid: int, exited_at: float,
                status: ProcessExit | None) -> dict[str, Any]:
    """Write the exit into the checkpoint's meta.json (unless it was forgotten or restored
    again since); returns the fields, for the event."""
    fields = {"exited_at": exited_at, **exit_fields(status), "status": describe_exit(status)}
    try:
        meta = store.get(checkpoint_id)
    except StoreError:
        return fields
    if meta.restored_pid != pid:
        return fields
    meta.exited_at = exited_at
    meta.exit_status = fields["exit_status"]
    meta.exit_signal = fields["exit_signal"]
    with contextlib.suppress(OSError, StoreError):
        store.update(meta)
    return fields


@dataclass
class _Watch:
    checkpoint_id: str
    pid: int
    since_ns: int  # exits of this pid before then were an earlier process's
    exited_at: float | None = None
    give_up_at: float = 0.0


class ExitWatch:
    """One thread; `watch(id, pid)` after a restore, `expect(seconds)` before it (the root
    may exit before it is watched). `on_exit(id, pid, exited_at, status or None)` is called
    from the thread."""

    def __init__(self, on_exit: ExitCallback, *,
                 open_events: Callable[[], EventSource] = lambda: ProcEvents(kinds=EXITS),
                 wall_clock: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.on_exit = on_exit
        self.open_events = open_events
        self.wall_clock = wall_clock
        self.clock = clock
        self.clock_ns = clock_ns
        self.events: EventSource | None = None
        self.why_no_status: str | None = None  # why the connector could not be opened
        self.events_lost = 0  # times the connector's buffer overflowed (exits may be missing)
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}  # pidfd -> watch
        self._recent: OrderedDict[int, ProcessExit] = OrderedDict()
        self._expect_until = 0.0
        self._wakeup = WakePipe()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- asked by the restorer ----------------------------------------------------------------

    def expect(self, seconds: float) -> int:
        """A restore starts: listen for exits for `seconds` (or until watched ones end).
        Returns the time to pass to watch()."""
        since = self.clock_ns()
        with self._lock:
            self._expect_until = max(self._expect_until, self.clock() + seconds)
            self._open_events()
            self._ensure_thread()
        return since

    def watch(self, checkpoint_id: str, pid: int, since_ns: int) -> None:
        """Report when `pid` (restored at or after `since_ns`, from expect()) exits."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            # Gone already (and reaped): what the connector saw, if anything.
            self._drain()
            with self._lock:
                status = self._status_of(pid, since_ns)
            self.on_exit(checkpoint_id, pid, self.wall_clock(), status)
            return
        with self._lock:
            # The thread closes the connector once nothing is watched and expect()'s time is
            # up, which can fall between expect() and this call (rewatch at start expects 0 s):
            # opened again here, or the exit would come with no status.
            self._open_events()
            self._watches[pidfd] = _Watch(checkpoint_id, pid, since_ns)
            self._ensure_thread()
        self._wakeup.wake()

    def why_unknown(self) -> str | None:
        """Why an exit status may be unknown: no connector, or events it lost."""
        if self.why_no_status is not None:
            return self.why_no_status
        if self.events_lost:
            return (f"the process-event connector's buffer overflowed (ENOBUFS, "
                    f"{self.events_lost}x): the exit event may be among those lost")
        return None

    def _status_of(self, pid: int, since_ns: int) -> ProcessExit | None:
        status = self._recent.get(pid)
        return status if status is not None and status.timestamp_ns >= since_ns else None

    def close(self) -> None:
        self._stopping = True
        self._wakeup.wake()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        with self._lock:
            for pidfd in self._watches:
                os.close(pidfd)
            self._watches.clear()
            self._close_events()
        self._wakeup.close()

    # -- the thread ---------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        """(With the lock held.) The thread ends, under the lock, once nothing is left."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="oomguard-exitwatch",
                                            daemon=True)
            self._thread.start()

    def _open_events(self) -> None:
        if self.events is None:
            try:
                self.events = self.open_events()
                self.why_no_status = None
            except OSError as exc:
                self.why_no_status = f"process-event connector unavailable ({unavailable(exc)})"

    def _close_events(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None

    def _drain(self) -> None:
        with self._lock:
            events = self.events
        if events is None:
            return
        batch = events.read()
        if batch.lost:
            with self._lock:
                self.events_lost += batch.lost
        for status in batch.events:
            if not isinstance(status, ProcessExit) or status.pid != status.tgid:
                continue  # a fork or an exec, or a thread's exit
            with self._lock:
                self._recent[status.tgid] = status
                self._recent.move_to_end(status.tgid)
                while len(self._recent) > RECENT_EXITS:
                    self._recent.popitem(last=False)

    def _run(self) -> None:
        while not self._stopping:
            poller = select.poll()
            poller.register(self._wakeup.fileno(), select.POLLIN)
            with self._lock:
                fds = list(self._watches)
                events = self.events
                pending = [w for w in self._watches.values() if w.exited_at is not None]
            for fd in fds:
                poller.register(fd, select.POLLIN)
            if events is not None:
                poller.register(events.fileno(), select.POLLIN)
            timeout = 1000 if not pending else 50
            for fd, _mask in poller.poll(timeout):
                if fd == self._wakeup.fileno():
                    self._wakeup.drain()
                elif fd in fds:
                    with self._lock:
                        watch = self._watches.get(fd)
                        if watch is not None and watch.exited_at is None:
                            watch.exited_at = self.wall_clock()
                            watch.give_up_at = self.clock() + STATUS_WAIT
            self._drain()
            self._settle()
            with self._lock:
                if not self._watches and self.clock() >= self._expect_until:
                    self._close_events()
                    self._thread = None
                    return  # nothing to do: the next expect() or watch() starts a thread

    def _settle(self) -> None:
        """Report every watched root that has exited and whose status is known (or waited
        for long enough, or cannot come: no connector)."""
        done = []
        with self._lock:
            for fd, watch in list(self._watches.items()):
                if watch.exited_at is None:
                    continue
                status = self._status_of(watch.pid, watch.since_ns)
                if status is None and self.events is not None and \
                        self.clock() < watch.give_up_at:
                    continue
                del self._watches[fd]
                os.close(fd)
                done.append((watch, status))
        for watch, status in done:
            assert watch.exited_at is not None
            self.on_exit(watch.checkpoint_id, watch.pid, watch.exited_at, status)


def _identify(pid: int) -> tuple[float, str] | None:
    """(start time, command line) of a running process, None if there is none."""
    try:
        process = psutil.Process(pid)
        return process.create_time(), " ".join(process.cmdline())
    except (psutil.Error, OSError):
        return None


def rewatch_restored(store: Store, watch: ExitWatch, *,
                     identify: Callable[[int], tuple[float, str] | None] = _identify,
                     slack: float = RESTORE_SLACK) -> list[str]:
    """At start: trees a previous run restored and that still run are watched again (the
    connector cannot have seen an exit before now). A process counts as the restored root
    when it has its pid and command and was started around the restore (not a pid reused
    since). Returns the ids watched again."""
    since = watch.clock_ns()
    found: list[tuple[str, int]] = []
    for meta in store.list():
        if meta.state != "restored" or meta.restored_pid is None or meta.exited_at is not None:
            continue
        seen = identify(meta.restored_pid)
        if seen is None or meta.restored_at is None:
            continue
        started, command = seen
        if command == meta.command and abs(started - meta.restored_at) <= slack:
            found.append((meta.id, meta.restored_pid))
    if found:
        watch.expect(0)
        for checkpoint_id, pid in found:
            watch.watch(checkpoint_id, pid, since)
    return [checkpoint_id for checkpoint_id, _pid in found]
