"""Never checkpoint yourself: a tree that holds oomguard (the daemon or the CLI acting
directly, their CRIU and helpers) or the process asking for the checkpoint is refused."""

from __future__ import annotations

import os

from oomguard.errors import CheckpointFailed, ProcessGone
from oomguard.procfs import ProcReader

OUTCOME_UNTOUCHED = "untouched"  # as checkpoint.OUTCOME_UNTOUCHED: refused before stopping


def own_tree_members(tree_pids: list[int], self_pids: list[int],
                     requester: int | None) -> list[tuple[int, str]]:
    """(pid, who) of every process in `tree_pids` that must not be stopped: oomguard itself
    and what it runs (`self_pids`), and the requesting process."""
    tree = set(tree_pids)
    found = [(pid, "oomguard itself" if index == 0 else "a process oomguard runs")
             for index, pid in enumerate(self_pids) if pid in tree]
    if requester is not None and requester in tree and requester not in self_pids:
        found.append((requester, "the process asking for the checkpoint"))
    return found


def refuse_own_tree(root: int, proc: ProcReader, requester: int | None = None,
                    self_pid: int | None = None) -> None:
    """Raise CheckpointFailed (outcome untouched) when the tree rooted at `root`, as CRIU
    would dump it (every descendant), holds oomguard or the requester: stopping it would
    stop the one who has to finish the checkpoint, and nothing would ever thaw it."""
    me = os.getpid() if self_pid is None else self_pid
    found = own_tree_members(proc.descendants(root), proc.descendants(me), requester)
    if found:
        who = ", ".join(f"{pid} ({what})" for pid, what in found)
        raise CheckpointFailed(
            f"checkpoint of {root} refused before stopping it: its process tree contains "
            f"{who}: stopping it would stop the one that has to carry out the checkpoint "
            "(name the job's own pid, not an ancestor of oomguard or of the caller)",
            OUTCOME_UNTOUCHED)


def own_family(proc: ProcReader, self_pid: int | None = None) -> frozenset[int]:
    """Never victims: oomguard, what it runs (its descendants) and its ancestors (a tree
    rooted at one would hold oomguard: freezing, killing or dumping it would take oomguard
    along). PID 1 is protected anyway."""
    me = os.getpid() if self_pid is None else self_pid
    family = set(proc.descendants(me))
    pid = me
    while True:
        try:
            pid = proc.process(pid).ppid
        except ProcessGone:
            break
        if pid <= 1 or pid in family:
            break
        family.add(pid)
    return frozenset(family)
