"""A standing ranking of the machine's processes by resident memory, for system rules.

Reading every process at the moment MemAvailable reaches the floor costs about a second with
ten thousand processes (a listing of /proc alone takes 13 ms), just when time matters most. So
while memory is getting low (the system rule says when) the ranking is refreshed in the
background: one read of /proc/PID/statm per process, /proc/PID/stat only for a process not
seen before (its parent and start time do not change). At the crossing only the few largest,
and their families, are read again in full; a process started since the last refresh (at most
REFRESH_EVERY old) is not among them unless `newcomers` (process events) names it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.sense.procfs import PF_KTHREAD, ProcessInfo, parse_stat

TOP = 16  # processes re-read in full at the crossing (system rules choose among the top 5)
REFRESH_EVERY = 5.0  # while memory is low, at most this often (~0.1 s of CPU per 10,000)
MAX_AGE = 15.0  # an older ranking is not used: the crossing reads everything, as without one


@dataclass(frozen=True)
class Brief:
    """What ranking needs of a process."""

    pid: int
    ppid: int
    starttime: int
    rss_bytes: int


@dataclass(frozen=True)
class Ranking:
    taken_at: float  # the clock's time
    processes: tuple[Brief, ...]  # largest first
    pids: frozenset[int] = field(default_factory=frozenset)
    children: dict[int, tuple[int, ...]] = field(default_factory=dict)
    by_pid: dict[int, Brief] = field(default_factory=dict)

    @staticmethod
    def of(taken_at: float, briefs: list[Brief]) -> Ranking:
        ordered = sorted(briefs, key=lambda b: (-b.rss_bytes, -b.starttime))
        children: dict[int, list[int]] = {}
        for brief in ordered:
            children.setdefault(brief.ppid, []).append(brief.pid)
        return Ranking(taken_at, tuple(ordered), frozenset(b.pid for b in ordered),
                       {k: tuple(v) for k, v in children.items()}, {b.pid: b for b in ordered})

    def top(self, count: int = TOP) -> list[int]:
        return [b.pid for b in self.processes[:count]]

    def family(self, roots: list[int]) -> list[int]:
        """`roots` and their descendants as the ranking saw them, parents first."""
        order, seen = list(roots), set(roots)
        index = 0
        while index < len(order):
            for child in self.children.get(order[index], ()):
                if child not in seen:
                    seen.add(child)
                    order.append(child)
            index += 1
        return order


def read_stat(proc_root: Path, pid: int) -> tuple[int, int] | None:
    """(ppid, starttime) of a user process; None for a kernel thread or one that is gone."""
    try:
        stat = parse_stat((proc_root / str(pid) / "stat").read_text(errors="replace"))
    except (OSError, ValueError, IndexError):
        return None
    if stat.flags & PF_KTHREAD or stat.ppid == 2:
        return None
    return stat.ppid, stat.starttime


def read_rss_pages(proc_root: Path, pid: int) -> int | None:
    """Resident pages from /proc/PID/statm (one read, no Python file object)."""
    try:
        fd = os.open(f"{proc_root}/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return int(os.read(fd, 256).split()[1])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def read_brief(proc_root: Path, pid: int, page_size: int) -> Brief | None:
    """stat and statm of one process; None for a kernel thread or a process that is gone."""
    parent = read_stat(proc_root, pid)
    rss = read_rss_pages(proc_root, pid) if parent is not None else None
    if parent is None or rss is None:
        return None
    return Brief(pid, parent[0], parent[1], rss * page_size)


def listed_pids(proc_root: Path) -> list[int]:
    return [int(name) for name in os.listdir(proc_root) if name.isdigit()]


class ProcessRanking:
    """`prepare()` when memory gets low: refreshes in a background thread at most every
    REFRESH_EVERY; `current()` the latest ranking younger than MAX_AGE, or None."""

    def __init__(self, proc_root: Path | str = "/proc", *,
                 clock: Callable[[], float] = time.monotonic,
                 page_size: int | None = None,
                 newcomers: Callable[[float], list[int]] | None = None) -> None:
        self.root = Path(proc_root)
        self.clock = clock
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self.newcomers = newcomers  # processes started since a time (process events), if known
        self._ranking: Ranking | None = None
        self._parents: dict[int, tuple[int, int] | None] = {}  # pid -> (ppid, starttime)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_started = -1e18

    def refresh(self) -> Ranking:
        """Read every process now (in the caller's thread) and keep the result."""
        taken = self.clock()
        known = self._parents
        parents: dict[int, tuple[int, int] | None] = {}
        briefs = []
        for pid in listed_pids(self.root):
            parent = known[pid] if pid in known else read_stat(self.root, pid)
            parents[pid] = parent
            if parent is None:
                continue
            rss = read_rss_pages(self.root, pid)
            if rss is not None:
                briefs.append(Brief(pid, parent[0], parent[1], rss * self.page_size))
        ranking = Ranking.of(taken, briefs)
        with self._lock:
            self._ranking = ranking
            self._parents = parents
        return ranking

    def prepare(self) -> None:
        """Memory is getting low: have a fresh ranking ready (without waiting for it)."""
        now = self.clock()
        with self._lock:
            if (self._thread is not None and self._thread.is_alive()) \
                    or now - self._last_started < REFRESH_EVERY:
                return
            self._last_started = now
            self._thread = threading.Thread(target=self.refresh, name="oomguard-ranking",
                                            daemon=True)
            self._thread.start()

    def current(self) -> Ranking | None:
        with self._lock:
            ranking = self._ranking
        if ranking is None or self.clock() - ranking.taken_at > MAX_AGE:
            return None
        return ranking

    def to_read(self, ranking: Ranking, count: int = TOP) -> list[int]:
        """The processes to read in full at the crossing: the `count` largest, and those
        started since the ranking was taken where `newcomers` can say (the families of the
        ones chosen come from Ranking.family)."""
        wanted = ranking.top(count)
        if self.newcomers is not None:
            known = set(wanted)
            wanted += [pid for pid in self.newcomers(ranking.taken_at) if pid not in known]
        return wanted


def stand_in(brief: Brief) -> ProcessInfo:
    """A process as the ranking saw it, for ranking only (no command line, owner or
    session): whatever is chosen is read in full before anything is done to it."""
    return ProcessInfo(pid=brief.pid, ppid=brief.ppid, comm="", state="S", uid=-1,
                       rss_bytes=brief.rss_bytes, starttime=brief.starttime, session=-1,
                       cmdline=(), kernel_thread=False, nspid=(brief.pid,))
