"""oomguard.policy for system-wide rules: candidates by own RSS, the MemAvailable floor, and
oom_score_adj = -1000 as protection."""

from __future__ import annotations

import dataclasses

import pytest

from oomguard.detect.memavailable import below_min_available
from oomguard.policy.victims import ProcessTree, build_trees, is_protected, rank_victims, system_candidates
from oomguard.sense.procfs import ProcessInfo
from tests.unit._support import MiB, proc_info

NONE: frozenset[int] = frozenset()
GiB = 1 << 30


def adj(proc: ProcessInfo, oom_score_adj: int) -> ProcessInfo:
    return dataclasses.replace(proc, oom_score_adj=oom_score_adj)


def _roots(trees: list[ProcessTree]) -> list[int]:
    return [t.root.pid for t in trees]


def _by_root(trees: list[ProcessTree]) -> dict[int, tuple[int, ...]]:
    return {t.root.pid: t.pids for t in trees}


# A desktop: a launcher (small itself) whose descendants are the big processes. (A desktop
# session's leader by name, gnome-session, is never a victim at all: tests/unit/test_sessions.py.)
DESKTOP = [
    proc_info(1, 0, 50),
    proc_info(1500, 1, 4, comm="launcher"),
    proc_info(1600, 1500, 300, comm="firefox"),
    proc_info(1601, 1600, 120, comm="firefox-tab"),
    proc_info(1602, 1600, 80, comm="firefox-tab"),
    proc_info(1700, 1500, 200, comm="ide"),
    proc_info(1701, 1700, 10, comm="lsp"),
    proc_info(2000, 1, 250, comm="database"),
]


# -- system_candidates ---------------------------------------------------------------------------

def test_system_candidates_rank_by_own_rss_not_tree() -> None:
    trees = system_candidates(DESKTOP, NONE)
    # the session tree holds 714 MiB but the session manager itself has 4: it is last
    assert _roots(trees) == [1600, 2000, 1700, 1601, 1602]
    # whereas the cgroup ranking (whole trees) would pick the session manager first
    assert rank_victims(build_trees(DESKTOP, NONE))[0].root.pid == 1500


def test_system_candidates_trees_hold_descendants() -> None:
    trees = system_candidates(DESKTOP, NONE, limit=10)
    assert _by_root(trees) == {
        1600: (1600, 1601, 1602),
        2000: (2000,),
        1700: (1700, 1701),
        1601: (1601,),
        1602: (1602,),
        1701: (1701,),
        1500: (1500, 1600, 1700, 1601, 1602, 1701),  # breadth first, by pid within a level
    }
    assert [t.rss_bytes // MiB for t in trees[:3]] == [500, 250, 210]


@pytest.mark.parametrize(
    ("limit", "roots"),
    [
        (0, []),
        (1, [1600]),
        (2, [1600, 2000]),
        (5, [1600, 2000, 1700, 1601, 1602]),
        (7, [1600, 2000, 1700, 1601, 1602, 1701, 1500]),
        (100, [1600, 2000, 1700, 1601, 1602, 1701, 1500]),  # pid 1 never
    ],
)
def test_system_candidates_limit(limit: int, roots: list[int]) -> None:
    assert _roots(system_candidates(DESKTOP, NONE, limit=limit)) == roots


def test_system_candidates_default_limit_is_five() -> None:
    procs = [proc_info(100 + i, 1, 10 + i) for i in range(8)]
    assert _roots(system_candidates(procs, NONE)) == [107, 106, 105, 104, 103]


@pytest.mark.parametrize(
    ("excluded", "protected"),
    [
        (proc_info(1, 0, 9000), NONE),  # init
        (proc_info(2, 0, 9000, kernel_thread=True), NONE),  # kthreadd
        (proc_info(300, 2, 9000, kernel_thread=True), NONE),  # a kernel thread
        (proc_info(301, 2, 9000), NONE),  # ppid 2 without the flag
        (proc_info(900, 1, 9000), frozenset({900})),  # oomguard itself
        (adj(proc_info(950, 1, 9000), -1000), NONE),  # opted out of OOM handling
    ],
    ids=["init", "kthreadd", "kthread", "ppid-2", "protected-pid", "oom-score-adj--1000"],
)
def test_system_candidates_exclude_protected(excluded: ProcessInfo, protected: frozenset[int]) -> None:
    procs = [excluded, proc_info(10, 1, 20), proc_info(11, 1, 10)]
    trees = system_candidates(procs, protected)
    assert _roots(trees) == [10, 11]
    assert all(excluded.pid not in t.pids for t in trees)


def test_system_candidates_protected_process_cuts_its_subtree_off() -> None:
    procs = [
        proc_info(30, 1, 100),
        adj(proc_info(31, 30, 500), -1000),  # e.g. sshd
        proc_info(32, 31, 50),  # a session under it
        proc_info(33, 32, 5),
        proc_info(34, 30, 1),
    ]
    trees = system_candidates(procs, NONE, limit=10)
    assert _by_root(trees) == {30: (30, 34), 32: (32, 33), 33: (33,), 34: (34,)}
    assert _roots(trees) == [30, 32, 33, 34]


def test_system_candidates_child_of_protected_pid_has_own_tree() -> None:
    procs = [proc_info(900, 1, 10), proc_info(901, 900, 400), proc_info(902, 901, 1)]
    assert _by_root(system_candidates(procs, frozenset({900}))) == {901: (901, 902), 902: (902,)}


@pytest.mark.parametrize(
    ("specs", "order"),
    [
        # (pid, rss_mib, starttime): equal own RSS -> the newer (larger starttime) first
        ([(10, 100, 500), (20, 100, 900)], [20, 10]),
        ([(20, 100, 900), (10, 100, 500)], [20, 10]),
        ([(10, 100, 900), (20, 100, 500)], [10, 20]),
        ([(10, 99, 900), (20, 100, 500)], [20, 10]),  # RSS first, then age
    ],
)
def test_system_candidates_ties_prefer_newer(specs: list[tuple[int, int, int]], order: list[int]) -> None:
    procs = [proc_info(pid, 1, rss, starttime=st) for pid, rss, st in specs]
    assert _roots(system_candidates(procs, NONE)) == order


def test_system_candidates_empty() -> None:
    assert system_candidates([], NONE) == []
    assert system_candidates([proc_info(1, 0, 100)], NONE) == []


# -- below_min_available -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("available", "total", "floor", "expected"),
    [
        # a fraction (float) of MemTotal
        (100, 1000, 0.10, True),  # exactly at the floor: at or under -> True
        (99, 1000, 0.10, True),
        (101, 1000, 0.10, False),
        (100, 1001, 0.10, True),  # floor int(100.1) = 100
        (101, 1001, 0.10, False),
        (int(16 * GiB * 0.05), 16 * GiB, 0.05, True),
        (int(16 * GiB * 0.05) + 1, 16 * GiB, 0.05, False),
        (0, 1000, 0.0, True),
        (1, 1000, 0.0, False),
        (1000, 1000, 1.0, True),
        # bytes (int)
        (512 * MiB, 16 * GiB, 512 * MiB, True),  # equal
        (512 * MiB - 1, 16 * GiB, 512 * MiB, True),
        (512 * MiB + 1, 16 * GiB, 512 * MiB, False),
        (0, 16 * GiB, 0, True),
        (1, 16 * GiB, 0, False),
        (100, 1000, 1, False),  # int 1 is one byte, not 100%
    ],
)
def test_below_min_available(available: int, total: int, floor: float | int, expected: bool) -> None:
    assert below_min_available(available, total, floor) is expected


# -- is_protected / build_trees with oom_score_adj -----------------------------------------------

@pytest.mark.parametrize(
    ("score_adj", "expected"),
    [(-1000, True), (-999, False), (-500, False), (0, False), (1000, False)],
)
def test_is_protected_oom_score_adj(score_adj: int, expected: bool) -> None:
    assert is_protected(adj(proc_info(4000, 1), score_adj), NONE) is expected


def test_build_trees_oom_score_adj_child_is_cut_out() -> None:
    procs = [
        proc_info(40, 1, 10),
        adj(proc_info(41, 40, 10), -1000),
        proc_info(42, 41, 10),  # grandchild under the excluded process
        proc_info(43, 42, 10),
        proc_info(44, 40, 10),
        adj(proc_info(45, 40, 10), -999),  # not excluded
    ]
    trees = build_trees(procs, NONE)
    # the excluded process's children become roots of their own trees
    assert _by_root(trees) == {40: (40, 44, 45), 42: (42, 43)}
    assert all(41 not in t.pids for t in trees)
