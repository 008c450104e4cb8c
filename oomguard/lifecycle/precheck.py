"""Why a tree is refused before it is stopped: what CRIU would fail on, found from /proc.

Each refusal leaves the tree untouched (never stopped) and says why; a lasting one keeps the
tree from being chosen again while it lives (oomguard/policy/unfit.py).
"""

from __future__ import annotations

from oomguard.cgroup.base import MemoryCgroup
from oomguard.lifecycle.jobroot import refuse_partial_job
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import ProcReader
from oomguard.sense.selfguard import refuse_own_tree
from oomguard.terminal.checkpointing import terminal_refusal


def refuse_before_stop(tree: ProcessTree, cgroup: MemoryCgroup | None, proc: ProcReader,
                       requester: int | None) -> None:
    """Raises CheckpointFailed (untouched) where the tree must not or cannot be dumped: it
    holds oomguard or the `requester`, it is rooted inside a PID namespace, a task of it is
    unfit (traced, protected), its session leader is outside oomguard's PID namespace, or it
    was typed at a shell prompt whose terminal cannot be taken along."""
    refuse_own_tree(tree.root.pid, proc, requester)
    refuse_partial_job(tree, cgroup, proc)  # never a tree rooted inside a PID namespace
    if tree.unfit:  # a traced task, a protected one below: CRIU would fail on it
        raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping it: "
                               f"{tree.unfit}", FailedCheckpoint.UNTOUCHED, lasting=tree.unfit)
    outside = [p.pid for p in tree.members if p.session == 0]
    if outside:
        # /proc shows session 0 when the session leader lives in an outer PID namespace (a
        # job started inside a container or sandbox without setsid): CRIU refuses such a
        # task, so say why now rather than after freezing it.
        raise CheckpointFailed(
            f"checkpoint of {tree.root.pid} refused before stopping it: the session leader "
            f"of pid(s) {', '.join(map(str, outside))} is outside oomguard's PID namespace, "
            "which CRIU cannot dump (start the job with setsid, or run oomguard in the "
            "job's PID namespace)", FailedCheckpoint.UNTOUCHED)
    members = set(tree.pids)
    if any(p.session not in members for p in tree.members):  # typed at a shell prompt
        problem = terminal_refusal(proc.root, tree.pids)
        if problem is not None:  # lasting: the tree is not chosen again while it lives
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping "
                                   f"it: {problem}", FailedCheckpoint.UNTOUCHED,
                                   lasting=problem)
