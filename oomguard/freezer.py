"""Stopping and resuming a process tree. SIGSTOP works on v1 and v2 alike and is what CRIU
expects of a tree it dumps (a stopped task is dumped and restored stopped).

Tasks the user had stopped (Ctrl-Z, SIGSTOP) before oomguard came are left as they are and
never continued by it: `Frozen.user_stopped` names them, `Frozen.ours` the tasks to continue."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from oomguard.errors import ProcessGone
from oomguard.procfs import ProcReader

STOPPED_STATES = frozenset("TtZX")  # stopped, traced, or already dead
USER_STOPPED_STATE = "T"  # job-control stop; "t" is a ptrace stop (a debugger's, or CRIU's)


@dataclass(frozen=True)
class Frozen:
    """A stopped tree: every task (`pids`, parents first) and those that were stopped before
    oomguard's SIGSTOP (`user_stopped`): they stay stopped whatever happens next."""

    pids: list[int]
    user_stopped: list[int] = field(default_factory=list)

    @property
    def ours(self) -> list[int]:
        """The tasks oomguard stopped: the ones a thaw or a restore continues."""
        kept = set(self.user_stopped)
        return [pid for pid in self.pids if pid not in kept]

    def plus_user_stopped(self, pids: Iterable[int]) -> Frozen:
        more = [pid for pid in pids if pid not in self.user_stopped]
        return Frozen(self.pids, self.user_stopped + more) if more else self


class Freezer(Protocol):
    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen: ...

    def wait_frozen(self, pids: Iterable[int], timeout: float) -> bool: ...

    def stopped_again(self, pids: Iterable[int]) -> list[int]: ...

    def thaw(self, pids: Iterable[int]) -> None: ...


def _signal(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class SigstopFreezer:
    """SIGSTOP a tree, re-listing it until no new child appears (a fork racing the freeze)."""

    def __init__(self, proc: ProcReader | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc or ProcReader()
        self.sleep = sleep
        self.clock = clock

    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen:
        """Stop every task of the tree. A task found stopped (state T) is the user's and gets
        no SIGSTOP, unless it is in `held` (stopped by oomguard already, e.g. a chain's freeze
        step)."""
        seen: list[int] = []
        user_stopped: list[int] = []
        for _ in range(50):
            new = [pid for pid in self.proc.descendants(root_pid) if pid not in seen]
            if not new:
                break
            for pid in new:
                seen.append(pid)
                try:
                    state = self.proc.state(pid)
                except ProcessGone:
                    continue
                if state == USER_STOPPED_STATE and pid not in held:
                    user_stopped.append(pid)
                else:
                    _signal(pid, signal.SIGSTOP)
        if not seen or not self.proc.exists(root_pid):
            raise ProcessGone(f"process {root_pid} is gone")
        return Frozen(seen, user_stopped)

    def wait_frozen(self, pids: Iterable[int], timeout: float) -> bool:
        """True once every task is stopped (or gone). A task in D state at the memory limit only
        stops once it can return to user space: give it headroom first."""
        pending = list(pids)
        deadline = self.clock() + timeout
        looks = 0
        while pending:
            still = []
            for pid in pending:
                try:
                    if self.proc.state(pid) not in STOPPED_STATES:
                        still.append(pid)
                except ProcessGone:
                    continue
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
            _signal(pid, signal.SIGCONT)


def kill_tree(pids: Iterable[int]) -> None:
    """The last resort: SIGKILL every task of the tree (stopped tasks die too)."""
    for pid in pids:
        _signal(pid, signal.SIGKILL)
