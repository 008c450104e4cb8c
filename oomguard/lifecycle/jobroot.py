"""The job a process belongs to, read from /proc: a process inside an `oomguard exec` job (a
PID namespace) stands for the whole job, from the namespace's init (policy/jobs.py says why).
`job_root` lifts a PID a person gave (`checkpoint PID`, `attach PID`) or a rule chose to its
job's init; `refuse_partial_job` is the checkpoint's last word: a tree rooted inside a PID
namespace is refused, with the reason, before anything is stopped."""

from __future__ import annotations

from oomguard.cgroup.base import MemoryCgroup
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint, ProcessGone
from oomguard.policy.jobs import MAX_ANCESTORS, below_namespace_init, namespace_init, partial_job_reason
from oomguard.policy.rights import untouchable_task
from oomguard.policy.victims import ProcessTree, is_protected
from oomguard.sense.procfs import ProcessInfo, ProcReader


def namespace_chain(proc: ProcReader, first: ProcessInfo) -> dict[int, ProcessInfo]:
    """`first` and its parents, as far as its PID namespace's init (or the first parent outside
    the namespace, or gone), by pid."""
    chain = {first.pid: first}
    current = first
    depth = len(first.nspid)
    for _ in range(MAX_ANCESTORS):
        if len(current.nspid) != depth or current.nspid[-1] == 1 or current.ppid <= 0 \
                or current.ppid in chain:
            break
        try:
            current = proc.process(current.ppid)
        except ProcessGone:
            break
        chain[current.pid] = current
    return chain


def job_init(proc: ProcReader, process: ProcessInfo) -> ProcessInfo | None:
    """The init of the PID namespace `process` is in (itself if it is one), None when it is in
    oomguard's namespace or the init is not above it."""
    if len(process.nspid) <= 1:
        return None
    return namespace_init(process, namespace_chain(proc, process))


def job_root(proc: ProcReader, pid: int, protected_pids: frozenset[int] = frozenset()) -> int:
    """The pid whose tree is `pid`'s job: its PID namespace's init when `pid` is inside an
    `oomguard exec` job (and the init may be taken), else `pid`. Raises ProcessGone."""
    process = proc.process(pid)
    if not below_namespace_init(process):
        return pid
    init = job_init(proc, process)
    return init.pid if init is not None and not is_protected(init, protected_pids) else pid


def refuse_partial_job(tree: ProcessTree, cgroup: MemoryCgroup | None, proc: ProcReader) -> None:
    """Raise CheckpointFailed (untouched) for a tree rooted inside a PID namespace, below its
    init: CRIU would stop it and then fail ("Can't dump a pid namespace without the process
    init"). The reason says what keeps the init out (protected, outside the cgroup...)."""
    root = tree.root
    if not below_namespace_init(root):
        return
    init = job_init(proc, root)
    init_cgroup = untouchable = None
    if init is not None:
        untouchable = untouchable_task(ProcessTree(root=init, members=(init,)), frozenset())
        try:
            init_cgroup = proc.memory_cgroup(init.pid)
        except ProcessGone:
            init_cgroup = None
    reason = partial_job_reason(root, init, init_cgroup,
                                cgroup.rel_path if cgroup is not None else None, untouchable)
    raise CheckpointFailed(f"checkpoint of {root.pid} refused before stopping it: {reason}",
                           FailedCheckpoint.UNTOUCHED)


def job_process(pid: int, proc: ProcReader | None = None) -> int:
    """The init of the `oomguard exec` job `pid` is in (it holds the job's terminal and names
    its holder), else `pid`."""
    try:
        return job_root(proc or ProcReader(), pid)
    except ProcessGone:
        return pid
