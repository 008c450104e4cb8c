"""Victims: the process trees of a cgroup (or of the machine), which are never candidates, and
their order (resident memory, plus GPU memory where known). Pure functions; no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from oomguard.policy.sessions import session_role
from oomguard.sense.procfs import ProcessInfo


@dataclass(frozen=True)
class ProcessTree:
    """A victim candidate: a process and its descendants inside the cgroup."""

    root: ProcessInfo
    members: tuple[ProcessInfo, ...]  # root first
    vram_bytes: int = 0  # GPU memory its processes hold (NVML), 0 where unknown
    # Why CRIU cannot dump it, found before anything is stopped ("" if nothing is known): a
    # traced task in it, or a task below it that is never a victim (`criu dump --tree ROOT`
    # takes every descendant). A checkpoint is refused; a rule's other actions may still run.
    unfit: str = ""

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.members)

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.members)

    @property
    def footprint(self) -> int:
        """What a checkpoint frees: resident memory plus GPU memory."""
        return self.rss_bytes + self.vram_bytes


OOM_SCORE_ADJ_MIN = -1000  # "never kill this": respected as "never checkpoint this"


def is_protected(proc: ProcessInfo, protected_pids: frozenset[int]) -> bool:
    """Never a victim: PID 1, kernel threads, oomguard itself and its helpers (CRIU), processes
    that opted out of OOM handling with oom_score_adj = -1000, and processes traced by one of
    oomguard's (a CRIU already dumping it). A task traced by anything else (strace, a
    debugger) may be a victim's member, but makes its tree unfit for a checkpoint."""
    return (proc.pid == 1 or proc.kernel_thread or proc.pid in protected_pids or proc.ppid == 2
            or proc.oom_score_adj <= OOM_SCORE_ADJ_MIN or proc.tracer_pid in protected_pids
            or exiting(proc))


def exiting(proc: ProcessInfo) -> bool:
    """A task on its way out (a zombie, or one whose memory is already released: no command
    line, no resident memory, as after an OOM kill): nothing left to checkpoint."""
    return proc.state in ("Z", "X") or (not proc.cmdline and proc.rss_bytes == 0)


def protection(proc: ProcessInfo, protected_pids: frozenset[int]) -> str:
    """Why a protected process is never a victim, in a few words."""
    if proc.tracer_pid and proc.tracer_pid in protected_pids:
        return "being dumped already"
    if proc.oom_score_adj <= OOM_SCORE_ADJ_MIN:
        return f"opted out of OOM handling (oom_score_adj {proc.oom_score_adj})"
    return "oomguard's own, or a process it never takes"


class _Family:
    """Processes, who is whose child, and which may be a victim tree's member. Whether one is
    a session process is asked as needed (a system rule's heads and their descendants only,
    not every process on the machine)."""

    def __init__(self, processes: Iterable[ProcessInfo], protected_pids: frozenset[int],
                 take_sessions: bool) -> None:
        self.protected_pids = protected_pids
        self.take_sessions = take_sessions
        self.by_pid = {p.pid: p for p in processes}
        self.children: dict[int, list[ProcessInfo]] = {}
        for proc in self.by_pid.values():
            self.children.setdefault(proc.ppid, []).append(proc)
        self._roles: dict[int, str | None] = {}

    def is_session(self, proc: ProcessInfo) -> bool:
        if self.take_sessions or exiting(proc):
            return False
        if proc.pid not in self._roles:
            self._roles[proc.pid] = session_role(proc)
        return self._roles[proc.pid] is not None

    def eligible(self, pid: int) -> bool:
        proc = self.by_pid.get(pid)
        return (proc is not None and not is_protected(proc, self.protected_pids)
                and not self.is_session(proc))

    def tree(self, root: ProcessInfo) -> ProcessTree | None:
        """`root` and its eligible descendants, parents before children (a pidns init below
        roots its own tree), with why CRIU could not dump it; None if it holds a session
        process (dumping or killing it would end that session)."""
        members = [root]
        ending: list[ProcessInfo] = []  # exiting children: still traced, as the case may be
        index = 0
        unfit = ""
        while index < len(members):
            for kid in sorted(self.children.get(members[index].pid, []), key=lambda p: p.pid):
                if kid.is_pidns_init:
                    continue
                if self.eligible(kid.pid):
                    members.append(kid)
                elif self.is_session(kid):
                    return None
                elif exiting(kid):
                    ending.append(kid)
                elif not unfit:
                    unfit = (f"pid {kid.pid} ({kid.comm}) below it is never a victim "
                             f"({protection(kid, self.protected_pids)}), and a dump of the "
                             "tree would take it")
            index += 1
        # A traced task on its way out (killed by the kernel's OOM killer) keeps the tree
        # unfit until it is gone: its tracer alone is no job of its own.
        traced = next((p for p in [*members, *ending]
                       if p.tracer_pid and p.tracer_pid not in self.protected_pids), None)
        if traced is not None:
            tracer = self.by_pid.get(traced.tracer_pid)
            by = f"{traced.tracer_pid} ({tracer.comm})" if tracer is not None \
                else str(traced.tracer_pid)
            unfit = (f"pid {traced.pid} ({traced.comm}) is traced by pid {by}: CRIU cannot "
                     "dump a traced task")
        return ProcessTree(root=root, members=tuple(members), unfit=unfit)


def build_trees(processes: Iterable[ProcessInfo], protected_pids: frozenset[int],
                take_sessions: bool = False) -> list[ProcessTree]:
    """Group processes into trees. A tree is rooted at a process whose parent is outside the set,
    protected, a session process (oomguard.policy.sessions: an interactive shell, a terminal
    multiplexer, an ssh session, a desktop session's leader), or which is the init of a nested
    PID namespace (so such a namespace is dumped whole from its init, the way `oomguard exec`
    workloads restore robustly). Session processes are never members, and a tree holding one
    below it is no candidate; `take_sessions` (a rule's) treats them as any other process."""
    family = _Family(processes, protected_pids, take_sessions)
    roots = [p for p in family.by_pid.values() if family.eligible(p.pid)
             and (not family.eligible(p.ppid) or p.is_pidns_init)]
    return [t for t in map(family.tree, roots) if t is not None]


SYSTEM_VICTIMS = 5  # system rules: trees rooted at this many of the largest processes


def system_heads(processes: Iterable[ProcessInfo], protected_pids: frozenset[int],
                 limit: int = SYSTEM_VICTIMS, take_sessions: bool = False) -> list[ProcessInfo]:
    """The `limit` processes with the most resident memory of their own that may be victims
    (never a session process, unless `take_sessions`)."""
    ranked = sorted((p for p in processes if not is_protected(p, protected_pids)),
                    key=lambda p: (-p.rss_bytes, -p.starttime))
    heads: list[ProcessInfo] = []
    for proc in ranked:
        if len(heads) >= limit:
            break
        if take_sessions or session_role(proc) is None:
            heads.append(proc)
    return heads


def system_tree(root_pid: int, processes: Iterable[ProcessInfo],
                protected_pids: frozenset[int], take_sessions: bool = False,
                ) -> ProcessTree | None:
    """The tree system_candidates would give the process `root_pid` among `processes` (its
    descendants that may be victims), None if it is absent, protected or holds a session."""
    family = _Family(processes, protected_pids, take_sessions)
    return family.tree(family.by_pid[root_pid]) if family.eligible(root_pid) else None


def system_candidates(processes: Iterable[ProcessInfo], protected_pids: frozenset[int],
                      limit: int = SYSTEM_VICTIMS, take_sessions: bool = False,
                      ) -> list[ProcessTree]:
    """System-wide rules: the `limit` processes with the most resident memory of their own (like
    earlyoom; a tree rooted at the session manager would hold the whole desktop), each with its
    descendants, largest first. A head whose tree holds a session process is left out."""
    processes = list(processes)
    family = _Family(processes, protected_pids, take_sessions)
    heads = system_heads(processes, protected_pids, limit, take_sessions)
    return [t for t in map(family.tree, heads) if t is not None]


def rank_victims(trees: Iterable[ProcessTree]) -> list[ProcessTree]:
    """Largest footprint (resident + GPU memory) first; ties go to the newer tree (the one
    that just started)."""
    return sorted(trees, key=lambda t: (-t.footprint, -t.root.starttime, t.root.pid))


def with_vram(trees: Iterable[ProcessTree], vram_by_pid: dict[int, int]) -> list[ProcessTree]:
    """The trees with the GPU memory of their processes counted (NVML's per-process usage)."""
    if not vram_by_pid:
        return list(trees)
    return [replace(t, vram_bytes=sum(vram_by_pid.get(pid, 0) for pid in t.pids))
            for t in trees]
