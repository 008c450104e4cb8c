"""Stopping and resuming a process tree. SIGSTOP works on v1 and v2 alike and is what CRIU
expects of a tree it dumps (a stopped task is dumped and restored stopped).

Tasks the user had stopped (Ctrl-Z, SIGSTOP) before oomguard came are left as they are and
never continued by it: `Frozen.user_stopped` names them, `Frozen.ours` the tasks to continue.

A fork racing the freeze: with the kernel's process-event connector the freeze follows the
forks exactly (oomguard.act.forkfollow). freeze() sends the SIGSTOPs and returns at once (a
task parked at the memory limit stops only once the headroom is given, a v2-frozen cgroup only
once thawed); wait_frozen() follows the forks until the whole tree has stopped, and closes the
subscription. Where the connector is unavailable, the tree is re-listed until no new child
appears (up to 50 times): a child forked after the last listing, before its parent stopped,
escapes.

A task another process continues after its SIGSTOP (tmux, a person's `kill -CONT`; how it is
told from one not stopped yet: oomguard.act.frozen) is not waited for: `Frozen.not_held`
names it (pid, comm, why) and the dump goes ahead (CRIU seizes its tasks with ptrace, which no
SIGCONT undoes). Where the wait times out, `Frozen.unstopped` names the threads it waited for.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Protocol

from oomguard.act.forkfollow import ForkFollow
from oomguard.act.frozen import (
    BY_LISTING,
    STOPPED_STATES,
    USER_STOPPED_STATE,
    BeforeStop,
    Frozen,
    Kill,
    continued,
    not_held,
    note_before_stop,
    send_signal,
    unstopped_threads,
)
from oomguard.model.errors import ProcessGone
from oomguard.sense.cnproc import FORKS
from oomguard.sense.procevents import Subscriber
from oomguard.sense.procfs import ProcReader

RELISTS = 50


class Freezer(Protocol):
    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen: ...

    def wait_frozen(self, frozen: Frozen, timeout: float) -> Frozen: ...

    def stopped_again(self, pids: Iterable[int]) -> list[int]: ...

    def thaw(self, pids: Iterable[int]) -> None: ...


class SigstopFreezer:
    """SIGSTOP a tree; forks racing the freeze are caught from the kernel's process events
    where it offers them (`events`), else by re-listing the tree."""

    def __init__(self, proc: ProcReader | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 events: Subscriber | None = None, kill: Kill = os.kill,
                 before_stop: BeforeStop | None = None) -> None:
        self.proc = proc or ProcReader()
        self.sleep = sleep
        self.clock = clock
        self.events = events if events is not None else Subscriber(kinds=FORKS)
        self.kill = kill
        # Called with each task before its SIGSTOP (the checkpointer's ledger notes it).
        self.before_stop = before_stop

    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen:
        """Stop every task of the tree. A task found stopped (state T) is the user's and gets
        no SIGSTOP, unless it is in `held` (stopped by oomguard already, e.g. a chain's freeze
        step). With the connector, the subscription stays open until wait_frozen()."""
        events = self.events.open()
        if events is None:
            return self._relist(root_pid, held, self.events.why_not or self.events.last_error)
        follow = ForkFollow(root_pid, events, self.proc, held, self.kill, self.before_stop)
        try:
            follow.walk()
            follow.drain()
            if not self.proc.exists(root_pid):
                raise ProcessGone(f"process {root_pid} is gone")
        except BaseException:
            follow.close()
            raise
        return follow.frozen()

    def _relist(self, root_pid: int, held: Collection[int], why: str | None) -> Frozen:
        seen: list[int] = []
        user_stopped: list[int] = []
        for _ in range(RELISTS):
            new = [pid for pid in self.proc.descendants(root_pid) if pid not in seen]
            if not new:
                break
            for pid in new:
                seen.append(pid)
                try:
                    state = self.proc.state(pid)
                except ProcessGone:
                    continue
                if state == USER_STOPPED_STATE:
                    if pid not in held:  # held: stopped by oomguard already (see take)
                        user_stopped.append(pid)
                else:
                    note_before_stop(self.before_stop, pid)
                    send_signal(pid, signal.SIGSTOP, self.kill)
        if not seen or not self.proc.exists(root_pid):
            raise ProcessGone(f"process {root_pid} is gone")
        return Frozen(seen, user_stopped, BY_LISTING, why_listing=why)

    def wait_frozen(self, frozen: Frozen, timeout: float) -> Frozen:
        """Wait until every task is stopped (or gone); returns the tree as it stopped, with
        `stopped` saying whether it did in time (and, where not, `unstopped`: each thread
        still running and where it sleeps). On the connector, children forked meanwhile are
        stopped and added. A task in D state at the memory limit only stops once it can
        return to user space: give it headroom first."""
        waited = self._wait_frozen(frozen, timeout)
        if waited.stopped is False:
            waited = replace(waited, unstopped=unstopped_threads(self.proc, waited.ours))
        return waited

    def _wait_frozen(self, frozen: Frozen, timeout: float) -> Frozen:
        follow = frozen.follow
        if follow is None:
            free: list[dict[str, object]] = []
            done = self._wait_states(frozen.pids, timeout, free)
            return replace(frozen, stopped=done, not_held=free)
        deadline = self.clock() + timeout
        looks = 0
        try:
            while True:
                follow.drain()
                if not follow.unsettled():
                    # Every task stopped: their forks are all queued. Nothing new in the
                    # socket and nothing new in the stopped tree: done.
                    if follow.reconcile() == 0 and follow.drain() == 0:
                        return follow.frozen(stopped=True)
                    continue
                if self.clock() >= deadline:
                    follow.reconcile()
                    return follow.frozen(stopped=False)
                looks += 1
                self.sleep(0.0002 if looks < 25 else 0.001)  # as _wait_states
        finally:
            follow.close()

    def _wait_states(self, pids: Iterable[int], timeout: float,
                     free: list[dict[str, object]]) -> bool:
        """Until every task has stopped, gone, or was continued by another process (added
        to `free`)."""
        tree = list(pids)
        pending = list(tree)
        deadline = self.clock() + timeout
        looks = 0
        while pending:
            still = []
            for pid in pending:
                try:
                    if self.proc.state(pid) in STOPPED_STATES:
                        continue
                except ProcessGone:
                    continue
                if continued(self.proc, pid):
                    free.append(not_held(self.proc, pid, tree))
                else:
                    still.append(pid)
            pending = still
            if not pending:
                return True
            if self.clock() >= deadline:
                return False
            looks += 1
            self.sleep(0.0002 if looks < 25 else 0.001)  # most stop within microseconds
        return True

    def stopped_again(self, pids: Iterable[int]) -> list[int]:
        """Of tasks oomguard stopped, those someone else stopped too (a stop signal arrived
        after ours, between the scan and the SIGSTOP or while oomguard held them): a stop
        signal sent to a stopped task stays pending until a SIGCONT discards it."""
        again = []
        for pid in pids:
            try:
                # Stopped and a stop pending: one of ours still pending in a task that has not
                # stopped yet (D state at the limit) is not this, and SIGCONT discards it.
                if (self.proc.state(pid) == USER_STOPPED_STATE
                        and self.proc.status(pid).stop_pending):
                    again.append(pid)
            except (ProcessGone, ValueError):
                continue
        return again

    def thaw(self, pids: Iterable[int]) -> None:
        """SIGCONT each task. (No second look at pending stops here: CRIU, giving back a task
        it found stopped, stops it again itself.)"""
        for pid in pids:
            send_signal(pid, signal.SIGCONT, self.kill)


def kill_tree(pids: Iterable[int]) -> None:
    """The last resort: SIGKILL every task of the tree (stopped tasks die too)."""
    for pid in pids:
        send_signal(pid, signal.SIGKILL)
