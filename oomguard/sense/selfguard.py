"""Never checkpoint yourself: a tree that holds oomguard (the daemon or the CLI acting
directly, their CRIU and helpers) or the process asking for the checkpoint is refused."""

from __future__ import annotations

import os

from oomguard.model.errors import CheckpointFailed, FailedCheckpoint
from oomguard.sense.procfs import ProcReader, parse_stat

OUTCOME_UNTOUCHED = FailedCheckpoint.UNTOUCHED  # refused before stopping


def ancestry(proc: ProcReader, pid: int) -> list[int]:
    """`pid`, its parent, and so on up to PID 1 (from /proc/PID/stat alone: cheap enough to
    run before every freeze). Stops where a process is gone."""
    chain = [pid]
    while pid > 1:
        try:
            text = (proc.root / str(pid) / "stat").read_text(errors="replace")
            pid = parse_stat(text).ppid
        except (OSError, ValueError, IndexError):
            break
        if pid <= 0 or pid in chain:
            break
        chain.append(pid)
    return chain


def own_tree_members(root: int, self_chain: list[int], root_chain: list[int],
                     requester_chain: list[int]) -> list[tuple[int, str]]:
    """(pid, who) that the tree rooted at `root` would take along. The tree holds a process
    exactly when `root` is that process or one of its ancestors; it holds a descendant of
    oomguard when oomguard is among `root`'s ancestors. Chains come from ancestry()."""
    found = []
    me = self_chain[0]
    if root in self_chain:
        found.append((me, "oomguard itself"))
    elif me in root_chain:
        found.append((root, "a process oomguard runs"))
    if requester_chain and root in requester_chain and requester_chain[0] != me:
        found.append((requester_chain[0], "the process asking for the checkpoint"))
    return found


def refuse_own_tree(root: int, proc: ProcReader, requester: int | None = None,
                    self_pid: int | None = None) -> None:
    """Raise CheckpointFailed (outcome untouched) when the tree rooted at `root`, as CRIU
    would dump it (every descendant), holds oomguard, a process it runs, or the requester:
    stopping it would stop the one who has to finish the checkpoint, and nothing would ever
    thaw it."""
    me = os.getpid() if self_pid is None else self_pid
    requester_chain = ancestry(proc, requester) if requester else []
    found = own_tree_members(root, ancestry(proc, me), ancestry(proc, root), requester_chain)
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
    return frozenset(proc.descendants(me)) | ancestors_of(proc, me)


def ancestors_of(proc: ProcReader, pid: int) -> frozenset[int]:
    """`pid`'s ancestors but PID 1: a tree rooted at one of them holds `pid`."""
    return frozenset(p for p in ancestry(proc, pid)[1:] if p > 1)
