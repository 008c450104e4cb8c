"""The policy: pure functions of a snapshot, the rule and the time. No I/O here."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace

from oomguard.cgroup.base import MemorySnapshot
from oomguard.model.units import format_size
from oomguard.procfs import ProcessInfo


class Verdict(enum.Enum):
    IDLE = "idle"  # below the threshold: sleep until the kernel says otherwise
    WATCH = "watch"  # usage above the threshold, but page cache, not resident memory: keep polling
    ACT = "act"  # resident memory at the threshold (or the cgroup is in OOM): checkpoint now


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


def evaluate(snapshot: MemorySnapshot, threshold: float) -> Decision:
    """Act when resident memory reaches `threshold` of the limit. The reason is for people
    (sizes in MiB/GiB); the events that carry it carry the raw numbers beside it.

    usage_in_bytes / memory.current include page cache, which the kernel reclaims before it
    OOM-kills anything, so a crossing seen on usage is confirmed against usage less page cache
    (anonymous memory plus the kernel memory charged with it, which no reclaim frees).
    """
    limit = snapshot.limit_bytes
    if limit is None:
        return Decision(Verdict.IDLE, "no memory limit")
    if snapshot.under_oom:
        return Decision(Verdict.ACT, "cgroup is under OOM")
    mark = threshold * limit
    resident = snapshot.unreclaimable_bytes
    if resident >= mark:
        return Decision(
            Verdict.ACT,
            f"resident {format_size(resident)} >= {threshold:.0%} of {format_size(limit)}",
        )
    if snapshot.usage_bytes >= mark:
        return Decision(Verdict.WATCH, "usage above threshold, mostly page cache")
    return Decision(Verdict.IDLE, "below threshold")


# A cache-only watch (usage over the threshold, resident memory not yet): how soon to look again.
WATCH_FIRST_S = 0.002  # right after the crossing: the second reading gives the growth
WATCH_MIN_S = 0.001
WATCH_MAX_S = 1.0  # while nothing grows (a cgroup full of page cache): backs off up to this


@dataclass(frozen=True)
class WatchLook:
    delay: float  # seconds until the next reading
    idle_interval: float  # the backed-off interval to carry while nothing grows (0: growing)


def next_watch_look(now: float, resident: int, mark: float, previous: tuple[float, int] | None,
                    idle_interval: float, poll_interval: float) -> WatchLook:
    """Usage is over the threshold but resident memory is not (the rest is page cache): read
    again when, at the growth seen since the `previous` (time, resident) reading, resident
    memory would be half way to the mark, so that the crossing is confirmed within about a
    millisecond whatever the rate; while it does not grow, back off from poll_interval to
    WATCH_MAX_S (the kernel's marks beyond the threshold, and on v1 its OOM notification,
    still wake the daemon at once)."""
    if previous is None:
        return WatchLook(min(WATCH_FIRST_S, poll_interval), 0.0)
    then, before = previous
    elapsed = now - then
    growth = (resident - before) / elapsed if elapsed > 0 else 0.0
    if growth <= 0:
        backed_off = min(max(WATCH_MAX_S, poll_interval), max(poll_interval, idle_interval * 2))
        return WatchLook(backed_off, backed_off)
    eta = (mark - resident) / growth
    return WatchLook(min(poll_interval, max(WATCH_MIN_S, eta / 2)), 0.0)


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


def below_min_available(available: int, total: int, min_available: float | int) -> bool:
    """System rules: MemAvailable at or under the floor (a fraction of MemTotal, or bytes)."""
    floor = int(total * min_available) if isinstance(min_available, float) else min_available
    return available <= floor


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


def headroom_needed(snapshot: MemorySnapshot, headroom: int) -> int | None:
    """The raised limit that gives the frozen tree `headroom` bytes to be seized and dumped
    (a task stuck at the limit cannot be; the parasite charges memory to the victim), or None."""
    if snapshot.limit_bytes is None:
        return None
    if snapshot.limit_bytes - snapshot.usage_bytes >= headroom:
        return None
    return snapshot.usage_bytes + headroom


def free_under_threshold(snapshot: MemorySnapshot, threshold: float) -> int | None:
    """Bytes between usage and the rule's threshold (negative when over it); None without a
    limit (everything fits)."""
    if snapshot.limit_bytes is None:
        return None
    return int(threshold * snapshot.limit_bytes) - snapshot.usage_bytes


def restore_fits(snapshot: MemorySnapshot, image_bytes: int, margin: int,
                 threshold: float) -> bool:
    """A checkpoint goes back (auto-restore, or `oomguard restore` into a guarded cgroup) only
    when it fits with room to spare: usage plus the image plus a margin stays under the
    threshold, so a restore never lands straight back in the pressure that caused the
    checkpoint (hysteresis)."""
    free = free_under_threshold(snapshot, threshold)
    return free is None or image_bytes + margin <= free
