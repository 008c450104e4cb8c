"""Stopping and resuming a process tree. SIGSTOP works on v1 and v2 alike and is what CRIU
expects of a tree it dumps (a stopped task is dumped and restored stopped)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from oomguard.errors import ProcessGone
from oomguard.procfs import ProcReader

STOPPED_STATES = frozenset("TtZX")  # stopped, traced, or already dead


class Freezer(Protocol):
    def freeze(self, root_pid: int) -> list[int]: ...

    def wait_frozen(self, pids: Iterable[int], timeout: float) -> bool: ...

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

    def freeze(self, root_pid: int) -> list[int]:
        stopped: list[int] = []
        for _ in range(50):
            new = [pid for pid in self.proc.descendants(root_pid) if pid not in stopped]
            if not new:
                break
            for pid in new:
                _signal(pid, signal.SIGSTOP)
                stopped.append(pid)
        if not stopped or not self.proc.exists(root_pid):
            raise ProcessGone(f"process {root_pid} is gone")
        return stopped

    def wait_frozen(self, pids: Iterable[int], timeout: float) -> bool:
        """True once every task is stopped (or gone). A task in D state at the memory limit only
        stops once it can return to user space: give it headroom first."""
        pending = list(pids)
        deadline = self.clock() + timeout
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
            self.sleep(0.001)
        return True

    def thaw(self, pids: Iterable[int]) -> None:
        for pid in pids:
            _signal(pid, signal.SIGCONT)


def kill_tree(pids: Iterable[int]) -> None:
    """The last resort: SIGKILL every task of the tree (stopped tasks die too)."""
    for pid in pids:
        _signal(pid, signal.SIGKILL)
