"""Victims: the process trees of a cgroup (or of the machine), which are never candidates, and
their order (resident memory, plus GPU memory where known). Pure functions; no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from oomguard.sense.procfs import ProcessInfo


@dataclass(frozen=True)
class ProcessTree:
    """A victim candidate: a process and its descendants inside the cgroup."""

    root: ProcessInfo
    members: tuple[ProcessInfo, ...]  # root first
    vram_bytes: int = 0  # GPU memory its processes hold (NVML), 0 where unknown

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
    that opted out of OOM handling with oom_score_adj = -1000, and traced processes (a
    debugger, or a CRIU already dumping it: ptrace allows one tracer)."""
    return (proc.pid == 1 or proc.kernel_thread or proc.pid in protected_pids or proc.ppid == 2
            or proc.oom_score_adj <= OOM_SCORE_ADJ_MIN or proc.tracer_pid != 0
            or exiting(proc))


def exiting(proc: ProcessInfo) -> bool:
    """A task on its way out (a zombie, or one whose memory is already released: no command
    line, no resident memory, as after an OOM kill): nothing left to checkpoint."""
    return proc.state in ("Z", "X") or (not proc.cmdline and proc.rss_bytes == 0)


def build_trees(processes: Iterable[ProcessInfo], protected_pids: frozenset[int]) -> list[ProcessTree]:
    """Group processes into trees. A tree is rooted at a process whose parent is outside the set,
    protected, or which is the init of a nested PID namespace (so such a namespace is dumped whole
    from its init, the way `oomguard exec` workloads restore robustly)."""
    eligible = {p.pid: p for p in processes if not is_protected(p, protected_pids)}
    children: dict[int, list[ProcessInfo]] = {}
    roots = []
    for proc in eligible.values():
        if proc.ppid in eligible and not proc.is_pidns_init:
            children.setdefault(proc.ppid, []).append(proc)
        else:
            roots.append(proc)
    return [_grow(root, children) for root in roots]


def _grow(root: ProcessInfo, children: dict[int, list[ProcessInfo]]) -> ProcessTree:
    """`root` and its descendants (from a parent -> children map), parents before children."""
    members = [root]
    index = 0
    while index < len(members):
        members.extend(sorted(children.get(members[index].pid, []), key=lambda p: p.pid))
        index += 1
    return ProcessTree(root=root, members=tuple(members))


SYSTEM_VICTIMS = 5  # system rules: trees rooted at this many of the largest processes


def system_heads(processes: Iterable[ProcessInfo], protected_pids: frozenset[int],
                 limit: int = SYSTEM_VICTIMS) -> list[ProcessInfo]:
    """The `limit` processes with the most resident memory of their own that may be victims."""
    eligible = [p for p in processes if not is_protected(p, protected_pids)]
    return sorted(eligible, key=lambda p: (-p.rss_bytes, -p.starttime))[:limit]


def system_tree(root_pid: int, processes: Iterable[ProcessInfo],
                protected_pids: frozenset[int]) -> ProcessTree | None:
    """The tree system_candidates would give the process `root_pid` among `processes` (its
    descendants that may be victims), None if it is absent or protected."""
    eligible = {p.pid: p for p in processes if not is_protected(p, protected_pids)}
    root = eligible.get(root_pid)
    if root is None:
        return None
    children: dict[int, list[ProcessInfo]] = {}
    for proc in eligible.values():
        children.setdefault(proc.ppid, []).append(proc)
    return _grow(root, children)


def system_candidates(processes: Iterable[ProcessInfo], protected_pids: frozenset[int],
                      limit: int = SYSTEM_VICTIMS) -> list[ProcessTree]:
    """System-wide rules: the `limit` processes with the most resident memory of their own (like
    earlyoom; a tree rooted at the session manager would hold the whole desktop), each with its
    descendants, largest first."""
    processes = list(processes)
    eligible = {p.pid: p for p in processes if not is_protected(p, protected_pids)}
    children: dict[int, list[ProcessInfo]] = {}
    for proc in eligible.values():
        children.setdefault(proc.ppid, []).append(proc)
    return [_grow(root, children) for root in system_heads(processes, protected_pids, limit)]


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
