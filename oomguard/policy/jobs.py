"""Jobs as a person sees them. `oomguard exec -- CMD` runs CMD under a small init
(oomguard/terminal/nsinit.py) as PID 1 of a new PID namespace; `top` and `ps` show CMD and its
children by their host PIDs. CRIU dumps such a namespace only whole, from its init ("Can't dump
a pid namespace without the process init"), so a process inside one stands for its whole job:
the init and every process under it. A job is shown by its own command (CMD, not the wrapper)
and by its main process (the init's first child: what the person started). Pure functions;
no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from oomguard.model.jobcommand import nsinit_job_argv
from oomguard.policy.victims import ProcessTree, is_protected, system_tree
from oomguard.sense.procfs import ProcessInfo

JOB_MAIN_NSPID = 2  # the init forks the job first: PID 2 of its namespace
MAX_ANCESTORS = 4096


def below_namespace_init(proc: ProcessInfo) -> bool:
    """Inside a PID namespace nested below oomguard's, and not its init: CRIU cannot dump a
    tree rooted here."""
    return len(proc.nspid) > 1 and proc.nspid[-1] != 1


def namespace_init(proc: ProcessInfo, by_pid: Mapping[int, ProcessInfo]) -> ProcessInfo | None:
    """The init (PID 1) of `proc`'s own PID namespace, found through its parents among
    `by_pid` (`proc` itself when it is one); None when `proc` is in oomguard's namespace, or
    its parents leave the namespace (or `by_pid`) before reaching an init: a process moved in
    with setns has its parent outside."""
    depth = len(proc.nspid)
    if depth <= 1:
        return None
    current: ProcessInfo | None = proc
    for _ in range(MAX_ANCESTORS):
        if current is None or len(current.nspid) != depth:
            return None
        if current.nspid[-1] == 1:
            return current
        current = by_pid.get(current.ppid)
    return None


def lift_to_jobs(trees: Iterable[ProcessTree], processes: Iterable[ProcessInfo],
                 protected_pids: frozenset[int]) -> list[ProcessTree]:
    """Trees rooted at a process inside an `oomguard exec` job (a system rule's largest
    process, a GPU memory holder), each replaced by its job's tree: the namespace's init and
    its descendants among `processes` that may be victims. Where the init is not among
    `processes` or is protected, the tree is left as it is: the checkpoint refuses it before
    stopping anything, saying why (oomguard.lifecycle.jobroot). Trees lifted to one init are
    one (the first place kept)."""
    known = list(processes)
    by_pid = {p.pid: p for p in known}
    lifted: list[ProcessTree] = []
    roots: set[int] = set()
    for tree in trees:
        if below_namespace_init(tree.root):
            init = namespace_init(tree.root, by_pid)
            if init is not None and not is_protected(init, protected_pids):
                tree = system_tree(init.pid, known, protected_pids) or tree
        if tree.root.pid not in roots:
            roots.add(tree.root.pid)
            lifted.append(tree)
    return lifted


def partial_job_reason(root: ProcessInfo, init: ProcessInfo | None, init_cgroup: str | None,
                       cgroup: str | None, init_untouchable: str | None) -> str:
    """Why a tree rooted at `root`, inside a PID namespace, may not be checkpointed:
    `init` is its namespace's init (None: not found above it), `init_cgroup` the init's memory
    cgroup and `cgroup` the one the tree is taken from (None: any), `init_untouchable` why no
    one may stop the init (oomguard.policy.rights.untouchable_task), if so."""
    head = (f"process {root.pid} ({root.comm}) is inside a PID namespace (an `oomguard exec` "
            "job), which CRIU dumps only whole, from the namespace's init")
    if init is None:
        return (f"{head}, and its init is not among its ancestors (a process moved in with "
                "setns): it cannot be checkpointed")
    if init_untouchable is not None:
        return f"{head}, and the init cannot be taken: {init_untouchable}"
    if cgroup is not None and init_cgroup is not None and not within(init_cgroup, cgroup):
        return (f"{head}, and the init, process {init.pid}, is outside the cgroup {cgroup} "
                f"(it is in {init_cgroup})")
    return f"{head}: checkpoint the whole job, from its init (`oomguard checkpoint {init.pid}`)"


def within(path: str, ancestor: str) -> bool:
    """Whether cgroup `path` is `ancestor` or beneath it (hierarchy paths)."""
    top = ancestor.rstrip("/")
    return top == "" or path == top or path.startswith(top + "/")


# -- the job's main process -----------------------------------------------------------------


def main_process(tree: ProcessTree) -> ProcessInfo:
    """The process a person sees as the job: for a PID namespace's init, its first child
    (PID 2 of the namespace, else the oldest child); otherwise the tree's root."""
    root = tree.root
    if not root.is_pidns_init:
        return root
    children = [p for p in tree.members if p.ppid == root.pid]
    for child in children:
        if child.nspid and child.nspid[-1] == JOB_MAIN_NSPID:
            return child
    return min(children, key=lambda p: (p.starttime, p.pid)) if children else root


def job_fields(tree: ProcessTree) -> dict[str, Any]:
    """meta.json's `job_command` and `job_pid` for a checkpoint of `tree`."""
    argv = nsinit_job_argv(tree.root.cmdline) if tree.root.is_pidns_init else None
    return {"job_command": " ".join(argv) if argv else tree.root.command,
            "job_pid": main_process(tree).pid}
