"""Trees that cannot be checkpointed while they live, and the memory of them.

A checkpoint that failed for a reason that cannot change while the tree lives (a traced task,
a file or socket CRIU cannot dump) is not tried again: the rule's next action runs, the next
victim is chosen, and the tree is marked (root pid and start time: pids are reused) so that no
later crossing chooses it again. A tree known unfit before anything is stopped
(ProcessTree.unfit) is marked the same way once it has been refused. Pure logic and state; no
I/O (whether a marked root still lives is asked of the caller)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from oomguard.policy.victims import ProcessTree

# CRIU's error lines (criu dump's log) that name what no retry changes: (pattern, reason).
LASTING: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), reason) for p, reason in (
    # PTRACE_SEIZE refused (err -1/ECHILD: CRIU never became its tracer): another tracer holds
    # it, whatever its state (S while strace lets it run, t while it stops it).
    (r"Unseizable non-zombie (?P<pid>\d+) found, state \w, err -1/",
     "pid {pid} could not be seized: another tracer holds it (a debugger, strace), or ptrace "
     "is not allowed on it"),
    (r"Can't dump file (?P<fd>\d+) of that type \[(?P<mode>\w+)\] \((?P<what>[^)]*)\)",
     "an open file of a kind CRIU cannot dump (fd {fd}: {what})"),
    (r"External socket is used|Can't dump half of stream unix connection|"
     r"Can't dump name-less external socket",
     "a unix socket connected to a process outside the tree"),
    (r"Connected TCP socket, consider using",
     "an established TCP connection (CRIU is not set up to dump one)"),
    (r"Can't dump a pid namespace without the process init",
     "a process of a PID namespace whose init is not in the tree"),
    (r"Can't dump nested (?P<ns>\w+) namespace",
     "a nested {ns} namespace, which CRIU cannot dump"),
    (r"Nested mount namespaces are not supported", "a nested mount namespace"),
    (r"Unsupported socket family|Unsupported proto \d+ for socket|Unsupported type \(\d+\) on "
     r"socket", "a socket of a kind CRIU cannot dump"),
    (r"The path \[(?P<path>[^\]]*)\] is not supported", "an open file at {path}, which CRIU "
     "cannot dump"),
    (r"Open files on overmounted mounts are not supported", "an open file on an over-mounted "
     "mount"),
    (r"Can't dump ghost file (?P<path>\S+) of", "a deleted, still open file ({path}) larger than "
     "CRIU's ghost file limit"),
    (r"The packetized mode for pipes is not supported", "a pipe in packet mode"),
    (r"PIDFD_THREAD flag is currently not supported", "a pidfd of a thread"),
))


def lasting_failure(criu_text: str) -> str | None:
    """Why a failed dump cannot succeed while the tree lives, from CRIU's error text; None if
    nothing in it says so (a timeout, a full disk, a task that exited: worth another try)."""
    for pattern, reason in LASTING:
        found = pattern.search(criu_text)
        if found is not None:
            return reason.format(**found.groupdict())
    return None


@dataclass(frozen=True)
class Mark:
    reason: str
    known_before: bool  # ProcessTree.unfit (re-checked: it may pass, a debugger detaches)


class UnfitMarks:
    """Trees never to be chosen again while they live, by (root pid, start time). Shared by
    every rule's actions (worker threads). `starttime_of(pid)`: when the process holding
    `pid` now started, 0 if none does (ProcReader.starttime)."""

    def __init__(self, starttime_of: Callable[[int], int]) -> None:
        self.starttime_of = starttime_of
        self._marks: dict[tuple[int, int], Mark] = {}
        self._lock = threading.Lock()

    def mark(self, tree: ProcessTree, reason: str, known_before: bool = False) -> None:
        with self._lock:
            self._marks[(tree.root.pid, tree.root.starttime)] = Mark(reason, known_before)

    def reason(self, tree: ProcessTree, fresh: bool = True) -> str | None:
        """Why the tree is marked, None if it is not, or no longer: a tree refused for what
        ProcessTree.unfit said, which it no longer says (a debugger detached), is a candidate
        again. `fresh`: the tree was read as it is now (not a ranking's stand-ins, which
        cannot tell)."""
        key = (tree.root.pid, tree.root.starttime)
        with self._lock:
            found = self._marks.get(key)
            if found is not None and found.known_before and fresh and not tree.unfit:
                del self._marks[key]
                return None
        return None if found is None else found.reason

    def split(self, trees: Iterable[ProcessTree], fresh: bool = True,
              ) -> tuple[list[ProcessTree], list[str]]:
        """The trees not marked, in their order, and the reasons of those left out."""
        kept, left = [], []
        for tree in trees:
            why = self.reason(tree, fresh)
            if why is None:
                kept.append(tree)
            else:
                left.append(f"pid {tree.root.pid} ({tree.root.comm}): {why}")
        return kept, left

    def forget_gone(self) -> None:
        """Drop the marks of trees whose root has exited (its pid free, or another's)."""
        with self._lock:
            for key in [k for k in self._marks if self.starttime_of(k[0]) != k[1]]:
                del self._marks[key]

    def __len__(self) -> int:
        return len(self._marks)
