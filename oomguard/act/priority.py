"""The niceness of the threads between a threshold crossing and the victim's SIGSTOP.

The work that fills memory often fills the CPUs too: at nice 0 the guard waits its turn
behind it, as earlyoom's -p (nice -20) also assumes. bench/ measures it (the 'contended'
part: the same load, nice 0 against the default); on this project's noisy 2-vCPU VM the gain
has ranged from 1.0x to 2.7x at the p95. Linux niceness is per thread, so only the threads on that path run at
`daemon.nice`: the event loop's, and an action worker's until its victim is stopped (a worker
waits for work at that niceness, so it wakes as promptly as the loop; once the tree is
stopped it drops back for the dump). Every such thread also carries SCHED_RESET_ON_FORK:
what it starts (CRIU, hooks, cuda-checkpoint, other threads) begins at nice 0, and a restored
process never inherits the guard's priority (CRIU gives it back its own).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class ThreadPriority:
    """Raise and lower the calling thread's niceness. `nice` 0: never touched."""

    def __init__(self, nice: int,
                 setpriority: Callable[[int, int, int], None] = os.setpriority,
                 getpriority: Callable[[int, int], int] = os.getpriority,
                 setscheduler: Callable[[int, int, os.sched_param], None] = os.sched_setscheduler,
                 thread_id: Callable[[], int] = threading.get_native_id) -> None:
        self.nice = nice
        self._set = setpriority
        self._get = getpriority
        self._scheduler = setscheduler
        self._thread_id = thread_id
        self.error: str | None = None  # why the niceness could not be raised (the first time)

    @property
    def enabled(self) -> bool:
        return self.nice != 0 and self.error is None

    def raise_(self) -> bool:
        """This thread at `nice` (and its children and new threads at 0). False, with
        `error` set, if the kernel refused (no CAP_SYS_NICE, RLIMIT_NICE): the guard then
        runs at its ordinary priority, and does not try again."""
        if not self.enabled:
            return False
        tid = self._thread_id()
        try:
            self._scheduler(tid, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
            self._set(os.PRIO_PROCESS, tid, self.nice)
        except OSError as exc:
            self.error = f"niceness {self.nice}: {exc.strerror or exc}"
            return False
        return True

    def lower(self) -> None:
        """This thread back at nice 0 (raising a niceness never needs a privilege)."""
        if not self.enabled:
            return
        tid = self._thread_id()
        try:
            if self._get(os.PRIO_PROCESS, tid) < 0:
                self._set(os.PRIO_PROCESS, tid, 0)
        except OSError as exc:  # only a thread that is gone: never here
            self.error = f"niceness 0: {exc.strerror or exc}"
