"""A tree as oomguard stopped it (Frozen), and how one of its tasks is read: stopped, or
continued by another process after its SIGSTOP, or neither yet (oomguard.act.freezer stops
trees; oomguard.act.forkfollow follows their forks on the connector).

A task that another process continues (tmux sends SIGCONT to a pane's program that anything
but a terminal read or write stopped; so does a person's `kill -CONT`) cannot be held by
SIGSTOP. It is told from a task that has not stopped yet (its SIGSTOP still pending: not yet
scheduled, or in the kernel at the memory limit) by the kernel's own bookkeeping: a stop
signal is taken off the pending set under the same lock that stops the thread taking it, and a
SIGCONT discards a pending one. So a task with no stop signal pending and no thread stopped
was continued.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import PF_EXITING, ProcReader, threads_told

if TYPE_CHECKING:
    from oomguard.act.forkfollow import ForkFollow


STOPPED_STATES = frozenset("TtZX")  # stopped, traced, or already dead
USER_STOPPED_STATE = "T"  # job-control stop; "t" is a ptrace stop (a debugger's, or CRIU's)
BY_EVENTS = "connector"  # how the freeze caught forks: the kernel's process events
BY_LISTING = "proc"  # or re-listing /proc/PID/task/*/children


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


Kill = Callable[[int, int], None]  # os.kill, or a test's
BeforeStop = Callable[[list[int]], None]  # the frozen ledger's note(): recorded first


def note_before_stop(before_stop: BeforeStop | None, pid: int) -> None:
    """Record-before-act: a task found for the freeze (a child forked since its tree was
    chosen and recorded) is in the frozen ledger before its SIGSTOP, so a daemon killed right
    after the signal leaves it to the next start to continue, never stopped for good (found
    stopped and not in the ledger, a task reads as its user's). A ledger that cannot be
    written stops it anyway: the freeze must hold the whole tree for CRIU."""
    if before_stop is not None:
        with contextlib.suppress(OSError):
            before_stop([pid])


def send_signal(pid: int, sig: signal.Signals, kill: Kill = os.kill) -> bool:
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


def unstopped_threads(proc: ProcReader, pids: Iterable[int]) -> list[dict[str, object]]:
    """The threads of these tasks that have not stopped, with their state and the kernel
    function they sleep in (a task in D at the memory limit, or sleeping out a memory.high
    penalty, stops only on its way back to user space): what a freeze that timed out waited
    for."""
    return threads_told(proc, pids, lambda wait: wait.state not in STOPPED_STATES)
