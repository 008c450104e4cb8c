"""Whether a caller may have a whole process tree checkpointed on demand: every task must be
theirs (real, effective and saved uid: a setuid-root child, as sudo runs, is not), and none may
be one the guards never touch (PID 1, kernel threads, oom_score_adj -1000, traced tasks,
oomguard and CRIU). Pure: decided from the tree as read, before anything is stopped."""

from __future__ import annotations

from collections.abc import Iterable

from oomguard.policy.victims import OOM_SCORE_ADJ_MIN, ProcessTree

ROOT = 0


def foreign_task(tree: ProcessTree, caller_uid: int) -> str | None:
    """Why `caller_uid` may not checkpoint `tree` (a task of another user), or None."""
    if caller_uid == ROOT:
        return None
    return foreign_of(((t.pid, t.comm, t.uids[:3] or (t.uid,)) for t in tree.members),
                      tree.root.pid, caller_uid)


def foreign_of(tasks: Iterable[tuple[int, str, tuple[int, ...]]], root: int,
               caller_uid: int) -> str | None:
    """As foreign_task, from (pid, comm, (real, effective, saved uid)) of each task: what the
    checkpointer reads again once the tree has stopped (a stopped task cannot exec)."""
    for pid, comm, ids in tasks:
        others = sorted({uid for uid in ids if uid != caller_uid})
        if others:
            which = "runs as" if ids[0] != caller_uid else "holds the rights of"
            return (f"process {pid} ({comm}) in the tree of {root} {which} "
                    f"uid {', '.join(map(str, others))}: every process of the tree must be "
                    "yours")
    return None


def untouchable_task(tree: ProcessTree, protected_pids: frozenset[int]) -> str | None:
    """Why no one may checkpoint `tree` (it holds a task the guards never touch), or None."""
    for task in tree.members:
        why = None
        if task.pid == 1 or task.kernel_thread or task.ppid == 2:
            why = "is PID 1 or a kernel thread"
        elif task.oom_score_adj <= OOM_SCORE_ADJ_MIN:
            why = "opted out of OOM handling (oom_score_adj -1000)"
        elif task.tracer_pid:
            why = f"is traced by process {task.tracer_pid} (a debugger, or a CRIU at work)"
        elif task.pid in protected_pids:
            why = "is oomguard or one of its helpers"
        if why is not None:
            return f"process {task.pid} ({task.comm}) in the tree of {tree.root.pid} {why}"
    return None
