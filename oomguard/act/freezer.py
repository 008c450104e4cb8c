"""Stopping and resuming a process tree. SIGSTOP works on v1 and v2 alike and is what CRIU
expects of a tree it dumps (a stopped task is dumped and restored stopped).

Tasks the user had stopped (Ctrl-Z, SIGSTOP) before oomguard came are left as they are and
never continued by it: `Frozen.user_stopped` names them, `Frozen.ours` the tasks to continue.

A fork racing the freeze: with the kernel's process-event connector (oomguard.sense.
procevents) the freeze subscribes before its first SIGSTOP, and every child whose fork event
names a parent in the tree is stopped at once (ForkFollow). It is exact: a stopped task cannot
fork, and a fork's event is queued before the parent returns to user space (where its pending
SIGSTOP takes it; a fork that has not reached the end of copy_process by then is undone and
restarted after the stop). So once every thread of every task in the set is seen stopped, one
last read of the socket and one walk of the stopped tree in /proc find nothing new. freeze()
sends the SIGSTOPs and returns at once (a task parked at the memory limit stops only once the
headroom is given, a v2-frozen cgroup only once thawed); wait_frozen() follows the forks until
the whole tree has stopped, and closes the subscription. Where the connector is unavailable,
the tree is re-listed until no new child appears (up to 50 times): a child forked after the
last listing, before its parent stopped, escapes.

A task that another process continues (tmux sends SIGCONT to a pane's program that anything
but a terminal read or write stopped; so does a person's `kill -CONT`) cannot be held by
SIGSTOP. It is told from a task that has not stopped yet (its SIGSTOP still pending: not yet
scheduled, or in the kernel at the memory limit) by the kernel's own bookkeeping: a stop
signal is taken off the pending set under the same lock that stops the thread taking it, and a
SIGCONT discards a pending one. So a task with no stop signal pending and no thread stopped
was continued. The wait does not wait for it: `Frozen.not_held` names it (pid, comm, why)
and the dump goes ahead (CRIU seizes its tasks with ptrace, which no SIGCONT undoes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from oomguard.model.errors import ProcessGone
from oomguard.sense.cnproc import FORKS, ProcessFork
from oomguard.sense.procevents import EventSource, Subscriber
from oomguard.sense.procfs import PF_EXITING, ProcReader, threads_told

STOPPED_STATES = frozenset("TtZX")  # stopped, traced, or already dead
USER_STOPPED_STATE = "T"  # job-control stop; "t" is a ptrace stop (a debugger's, or CRIU's)
BY_EVENTS = "connector"  # how the freeze caught forks: the kernel's process events
BY_LISTING = "proc"  # or re-listing /proc/PID/task/*/children
RELISTS = 50


@dataclass(frozen=True)
class Frozen:
    """A stopped tree: every task (`pids`, parents first) and those that were stopped before
    oomguard's SIGSTOP (`user_stopped`): they stay stopped whatever happens next.

    `method`: how forks racing the freeze were caught (BY_EVENTS or BY_LISTING, then
    `why_listing` says why); `caught`: children stopped on their fork event; `left`: tasks
    that left the tree before it stopped (their parent exited and they were reparented out
    of it: CRIU cannot dump them with it; continued unless the user's); `events_lost`: times
    the connector's buffer overflowed (then /proc was walked again); `stopped`: whether
    wait_frozen saw every task stopped (None before it). `follow` is the live subscription
    between freeze() and wait_frozen()."""

    pids: list[int]
    user_stopped: list[int] = field(default_factory=list)
    method: str = BY_LISTING
    why_listing: str | None = None
    caught: int = 0
    left: list[int] = field(default_factory=list)
    events_lost: int = 0
    stopped: bool | None = None
    follow: ForkFollow | None = field(default=None, compare=False, repr=False)
    # Continued by another process after oomguard's SIGSTOP: {"pid", "comm", "why"} each.
    not_held: list[dict[str, object]] = field(default_factory=list)
    others_held: tuple[int, ...] = ()  # the rest of its cgroup, stopped for the dump
    # Where the wait timed out: the threads not stopped, {"pid", "tid", "state", "wchan"} each.
    unstopped: list[dict[str, object]] = field(default_factory=list)

    @property
    def ours(self) -> list[int]:
        """The tasks oomguard stopped: the ones a thaw or a restore continues."""
        kept = set(self.user_stopped)
        return [pid for pid in self.pids if pid not in kept]

    def plus_user_stopped(self, pids: Iterable[int]) -> Frozen:
        more = [pid for pid in pids if pid not in self.user_stopped]
        return replace(self, user_stopped=self.user_stopped + more) if more else self

    def fields(self) -> dict[str, object]:
        """For the victim.frozen event: how forks were caught, and what escaped the tree."""
        found: dict[str, object] = {"freeze": self.method}
        if self.method == BY_EVENTS:
            found["forks_caught"] = self.caught
        if self.why_listing:
            found["freeze_fallback"] = self.why_listing
        if self.left:
            found["left_tree"] = self.left
        if self.events_lost:
            found["events_lost"] = self.events_lost
        if self.stopped is False:
            found["all_stopped"] = False  # the wait timed out: some task had not stopped
            found["unstopped"] = self.unstopped
        if self.not_held:
            found["not_held"] = self.not_held
        if self.others_held:
            found["others_held"] = list(self.others_held)
        return found


class Freezer(Protocol):
    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen: ...

    def wait_frozen(self, frozen: Frozen, timeout: float) -> Frozen: ...

    def stopped_again(self, pids: Iterable[int]) -> list[int]: ...

    def thaw(self, pids: Iterable[int]) -> None: ...


Kill = Callable[[int, int], None]  # os.kill, or a test's
BeforeStop = Callable[[list[int]], None]  # the frozen ledger's note(): recorded first


def _note(before_stop: BeforeStop | None, pid: int) -> None:
    """Record-before-act: a task found for the freeze (a child forked since its tree was
    chosen and recorded) is in the frozen ledger before its SIGSTOP, so a daemon killed right
    after the signal leaves it to the next start to continue, never stopped for good (found
    stopped and not in the ledger, a task reads as its user's). A ledger that cannot be
    written stops it anyway: the freeze must hold the whole tree for CRIU."""
    if before_stop is not None:
        with contextlib.suppress(OSError):
            before_stop([pid])


def _signal(pid: int, sig: signal.Signals, kill: Kill = os.kill) -> bool:
    try:
        kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def continued(proc: ProcReader, pid: int) -> bool:
    """A task seen not stopped that someone continued after its SIGSTOP (the module's
    docstring says why this is exact): no stop signal pending, then no thread stopped. The
    order matters: a stop taken between the two reads leaves its thread stopped. A task on
    its way out (a kill discards stop signals) is not: it is waited for until it is gone."""
    try:
        if proc.status(pid).stop_pending:
            return False
        states = proc.thread_states(pid)
        exiting = bool(proc.stat(pid).flags & PF_EXITING)
    except (ProcessGone, ValueError):
        return False
    return bool(states) and not exiting and not any(state in STOPPED_STATES for state in states)


def not_held(proc: ProcReader, pid: int, tree: Collection[int]) -> dict[str, object]:
    """The event's account of a task that was continued: pid, comm, and why (its parent, where
    that is outside the tree: tmux continues its panes' programs)."""
    try:
        stat = proc.stat(pid)
    except ProcessGone:
        return {"pid": pid, "comm": "", "why": "continued by another process after SIGSTOP"}
    why = "continued by another process after SIGSTOP"
    if stat.ppid not in tree:
        try:
            parent = proc.stat(stat.ppid).comm
        except ProcessGone:
            parent = "?"
        why += f"; its parent {stat.ppid} ({parent}) is outside the tree"
    return {"pid": pid, "comm": stat.comm, "why": why + ": dumped as it runs"}


class ForkFollow:
    """One freeze on the connector: the tree's tasks as found by a walk of /proc and by fork
    events, each stopped as it is found (or noted as the user's)."""

    def __init__(self, root: int, events: EventSource, proc: ProcReader,
                 held: Collection[int] = (), kill: Kill = os.kill,
                 before_stop: BeforeStop | None = None) -> None:
        self.root = root
        self.kill = kill
        self.before_stop = before_stop
        self.events = events
        self.proc = proc
        self.held = frozenset(held)
        self.members: dict[int, int] = {}  # pid -> start time, in the order found (parents
        # before children); with the pid, the start time names one process (pids are reused)
        self.user_stopped: list[int] = []
        self.settled: set[int] = set()  # seen stopped in every thread, or gone, or continued
        self.not_held: list[dict[str, object]] = []  # continued by another process
        self.caught = 0
        self.lost = 0
        self.left: list[int] = []
        self.tree: list[int] | None = None  # the stopped tree, as the final walk saw it

    def take(self, pid: int) -> None:
        """A new task of the tree: the user's if found stopped (and not `held`), else
        SIGSTOPped."""
        self.members[pid] = 0
        try:
            stat = self.proc.stat(pid)
        except ProcessGone:
            self.settled.add(pid)
            return
        self.members[pid] = stat.starttime
        if stat.state == USER_STOPPED_STATE:
            # Held: stopped by oomguard already. No second SIGSTOP: it would stay pending in
            # the stopped task and read as the user's (stopped_again).
            if pid not in self.held:
                self.user_stopped.append(pid)
            return
        _note(self.before_stop, pid)
        if not _signal(pid, signal.SIGSTOP, self.kill):
            self.settled.add(pid)

    def walk(self) -> tuple[int, list[int]]:
        """The root's tree in /proc now, each task stopped before its children are listed;
        returns how many were new and the tree, parents first."""
        new, tree, index = 0, [self.root], 0
        seen = {self.root}
        while index < len(tree):
            pid = tree[index]
            index += 1
            if pid not in self.members:
                self.take(pid)
                new += 1
            for kid in self.proc.children_of(pid):
                if kid not in seen:
                    seen.add(kid)
                    tree.append(kid)
        return new, tree

    def drain(self) -> int:
        """Every event queued: a new process whose parent is in the tree is stopped at once.
        (Exit events are not trusted to end a task: a group leader may exit before its other
        threads; /proc says when the whole process has.) After lost events, /proc is walked
        again. Returns how many tasks were new."""
        batch = self.events.read()
        new = 0
        for event in batch.events:
            if (isinstance(event, ProcessFork) and event.new_process
                    and event.parent_tgid in self.members
                    and event.child_tgid not in self.members):
                self.take(event.child_tgid)
                self.caught += 1
                new += 1
        if batch.lost:
            self.lost += batch.lost
            new += self.walk()[0]
        return new

    def unsettled(self) -> list[int]:
        """Tasks not yet seen stopped (in every thread) or gone."""
        waiting = []
        for pid in self.members:
            if pid in self.settled:
                continue
            try:
                states = self.proc.thread_states(pid)
            except ProcessGone:
                states = []
            if all(state in STOPPED_STATES for state in states) or not self._same(pid):
                self.settled.add(pid)  # stopped, or gone (its pid taken by another process)
            elif continued(self.proc, pid):
                self.settled.add(pid)  # never held: waiting for it would wait out the timeout
                self.not_held.append(not_held(self.proc, pid, self.members))
            else:
                waiting.append(pid)
        return waiting

    def _same(self, pid: int) -> bool:
        return self.proc.starttime(pid) == self.members[pid] != 0

    def reconcile(self) -> int:
        """Walk the stopped tree: a task no event named is stopped (returns how many), and
        a task that left the tree (reparented out of it) is let go: continued, unless the
        user's."""
        new, tree = self.walk()
        inside = set(tree)
        self.tree = [pid for pid in tree if self.proc.exists(pid)]
        for pid in self.members:
            if pid not in inside and pid not in self.left and self._same(pid):
                self.left.append(pid)
                if pid not in self.user_stopped:
                    _signal(pid, signal.SIGCONT, self.kill)
        return new

    def frozen(self, stopped: bool | None = None) -> Frozen:
        pids = self.tree if self.tree is not None else list(self.members)
        kept = set(pids)
        return Frozen(list(pids), [p for p in self.user_stopped if p in kept], BY_EVENTS,
                      caught=self.caught, left=list(self.left), events_lost=self.lost,
                      stopped=stopped, follow=None if stopped is not None else self,
                      not_held=list(self.not_held))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.events.close()


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
                    _note(self.before_stop, pid)
                    _signal(pid, signal.SIGSTOP, self.kill)
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
            _signal(pid, signal.SIGCONT, self.kill)


def unstopped_threads(proc: ProcReader, pids: Iterable[int]) -> list[dict[str, object]]:
    """The threads of these tasks that have not stopped, with their state and the kernel
    function they sleep in (a task in D at the memory limit, or sleeping out a memory.high
    penalty, stops only on its way back to user space): what a freeze that timed out waited
    for."""
    return threads_told(proc, pids, lambda wait: wait.state not in STOPPED_STATES)


def kill_tree(pids: Iterable[int]) -> None:
    """The last resort: SIGKILL every task of the tree (stopped tasks die too)."""
    for pid in pids:
        _signal(pid, signal.SIGKILL)
