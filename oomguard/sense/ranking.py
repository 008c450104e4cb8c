"""A standing ranking of the machine's processes by resident memory, for system rules.

Reading every process at the moment MemAvailable reaches the floor costs tens of milliseconds
per thousand processes, just when time matters most. So while memory is getting low (the
system rule says when) the ranking is refreshed in the background from two small files per
process (/proc/PID/stat and statm); at the crossing only the few largest, and their families,
are read again in full, plus any process that appeared since the refresh."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.procfs import PF_KTHREAD, parse_stat

TOP = 16  # processes re-read in full at the crossing (system rules choose among the top 5)
REFRESH_EVERY = 1.0  # while memory is low, at most this often
MAX_AGE = 5.0  # an older ranking is not used: the crossing reads everything, as without one


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

    @staticmethod
    def of(taken_at: float, briefs: list[Brief]) -> Ranking:
        ordered = sorted(briefs, key=lambda b: (-b.rss_bytes, -b.starttime))
        children: dict[int, list[int]] = {}
        for brief in ordered:
            children.setdefault(brief.ppid, []).append(brief.pid)
        return Ranking(taken_at, tuple(ordered), frozenset(b.pid for b in ordered),
                       {k: tuple(v) for k, v in children.items()})

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


def read_brief(proc_root: Path, pid: int, page_size: int) -> Brief | None:
    """stat and statm of one process; None for a kernel thread or a process that is gone."""
    base = proc_root / str(pid)
    try:
        stat = parse_stat((base / "stat").read_text(errors="replace"))
        rss_pages = int((base / "statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    if stat.flags & PF_KTHREAD or stat.ppid == 2:
        return None
    return Brief(stat.pid, stat.ppid, stat.starttime, rss_pages * page_size)


def listed_pids(proc_root: Path) -> list[int]:
    return [int(name) for name in os.listdir(proc_root) if name.isdigit()]


class ProcessRanking:
    """`prepare()` when memory gets low: refreshes in a background thread at most every
    REFRESH_EVERY; `current()` the latest ranking younger than MAX_AGE, or None."""

    def __init__(self, proc_root: Path | str = "/proc", *,
                 clock: Callable[[], float] = time.monotonic,
                 page_size: int | None = None) -> None:
        self.root = Path(proc_root)
        self.clock = clock
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._ranking: Ranking | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_started = -1e18

    def refresh(self) -> Ranking:
        """Read every process now (in the caller's thread) and keep the result."""
        taken = self.clock()
        briefs = [b for b in (read_brief(self.root, pid, self.page_size)
                              for pid in listed_pids(self.root)) if b is not None]
        ranking = Ranking.of(taken, briefs)
        with self._lock:
            self._ranking = ranking
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
        """The processes to read in full at the crossing: the `count` largest and their
        families, and every process that appeared since the ranking was taken (one listing of
        /proc, no per-process reads)."""
        wanted = ranking.family(ranking.top(count))
        known = set(wanted)
        newcomers = [pid for pid in listed_pids(self.root)
                     if pid not in ranking.pids and pid not in known]
        return wanted + newcomers
