"""oomguard.policy: the verdict, the victim trees, their ranking, the headroom."""

from __future__ import annotations

import pytest

from oomguard.cgroup.base import MemorySnapshot
from oomguard.policy.pressure import Verdict, evaluate, headroom_needed
from oomguard.policy.victims import ProcessTree, build_trees, is_protected, rank_victims
from oomguard.sense.procfs import ProcessInfo
from tests.unit._support import MiB, proc_info

NONE: frozenset[int] = frozenset()


def snap(usage_mib: float, limit_mib: float | None, anon_mib: float, *, file_mib: float = 0,
         under_oom: bool = False) -> MemorySnapshot:
    return MemorySnapshot(
        usage_bytes=int(usage_mib * MiB),
        limit_bytes=None if limit_mib is None else int(limit_mib * MiB),
        anon_bytes=int(anon_mib * MiB), file_bytes=int(file_mib * MiB), oom_kills=0,
        under_oom=under_oom)


# -- evaluate ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("snapshot", "threshold", "verdict", "reason"),
    [
        (snap(900, None, 900), 0.85, Verdict.IDLE, "no memory limit"),
        (snap(900, None, 900, under_oom=True), 0.85, Verdict.IDLE, "no memory limit"),
        (snap(10, 1000, 5, under_oom=True), 0.85, Verdict.ACT, "cgroup is under OOM"),
        (snap(900, 1000, 860), 0.85, Verdict.ACT, "resident "),
        (snap(1000, 1000, 1000), 0.85, Verdict.ACT, "resident "),
        (snap(1000, 1000, 100, file_mib=900), 0.85, Verdict.WATCH, "page cache"),
        (snap(850, 1000, 840, file_mib=10), 0.85, Verdict.WATCH, "page cache"),
        # the rest of usage is kernel memory (page tables, slab): no reclaim frees it
        (snap(852, 1000, 846, file_mib=1), 0.85, Verdict.ACT, "resident 851.0MiB"),
        (snap(500, 1000, 500), 0.85, Verdict.IDLE, "below threshold"),
        (snap(0, 1000, 0), 0.85, Verdict.IDLE, "below threshold"),
        (snap(1000, 1000, 999, file_mib=1), 1.0, Verdict.WATCH, "page cache"),
        (snap(1000, 1000, 1000), 1.0, Verdict.ACT, "resident "),
    ],
    ids=["no-limit", "no-limit-under-oom", "under-oom", "anon-above", "anon-at-limit",
         "page-cache", "usage-at-mark-anon-below", "kernel-memory-counts", "below", "empty",
         "threshold-100-below", "threshold-100-at"],
)
def test_evaluate(snapshot: MemorySnapshot, threshold: float, verdict: Verdict, reason: str) -> None:
    decision = evaluate(snapshot, threshold)
    assert decision.verdict is verdict
    assert reason in decision.reason


@pytest.mark.parametrize(
    ("anon", "usage", "file", "verdict"),
    [
        (499, 499, 0, Verdict.IDLE),
        (500, 500, 0, Verdict.ACT),  # exactly at the mark acts (>=)
        (499, 500, 1, Verdict.WATCH),  # usage exactly at the mark, one byte of it cache
        (499, 500, 0, Verdict.ACT),  # ...one byte of it kernel memory
        (501, 501, 0, Verdict.ACT),
    ],
)
def test_evaluate_exact_boundary(anon: int, usage: int, file: int, verdict: Verdict) -> None:
    s = MemorySnapshot(usage_bytes=usage, limit_bytes=1000, anon_bytes=anon, file_bytes=file,
                       oom_kills=0, under_oom=False)
    assert evaluate(s, 0.5).verdict is verdict


def test_evaluate_act_reason_shows_sizes_for_people() -> None:
    d = evaluate(MemorySnapshot(usage_bytes=900, limit_bytes=1000, anon_bytes=870, file_bytes=30,
                                oom_kills=0, under_oom=False), 0.85)
    assert d.reason == "resident 870B >= 85% of 1000B"
    d = evaluate(MemorySnapshot(usage_bytes=356950016, limit_bytes=400 << 20,
                                anon_bytes=356950016, file_bytes=0, oom_kills=0,
                                under_oom=False), 0.85)
    assert d.reason == "resident 340.4MiB >= 85% of 400.0MiB"


# -- is_protected / build_trees ------------------------------------------------------------------

@pytest.mark.parametrize(
    ("proc", "protected", "expected"),
    [
        (proc_info(1, 0), NONE, True),
        (proc_info(2, 0, kernel_thread=True), NONE, True),
        (proc_info(187, 2, kernel_thread=True), NONE, True),
        (proc_info(300, 2), NONE, True),  # ppid 2: a kthreadd child
        (proc_info(400, 1), frozenset({400}), True),
        (proc_info(400, 1), frozenset({401}), False),
        (proc_info(500, 400), NONE, False),
        (proc_info(1, 0, nspid=(1,)), NONE, True),
    ],
    ids=["init", "kthreadd", "kworker", "ppid-2", "own-pid", "other-pid", "ordinary", "init-nspid"],
)
def test_is_protected(proc: ProcessInfo, protected: frozenset[int], expected: bool) -> None:
    assert is_protected(proc, protected) is expected


def _by_root(trees: list[ProcessTree]) -> dict[int, tuple[int, ...]]:
    return {t.root.pid: t.pids for t in trees}


def test_build_trees_protected_never_appear() -> None:
    procs = [
        proc_info(1, 0, 10),
        proc_info(2, 0, 0, kernel_thread=True),
        proc_info(187, 2, 0, kernel_thread=True),
        proc_info(300, 2, 50),  # ppid 2 but not flagged as a kernel thread
        proc_info(900, 1, 30),  # oomguard
        proc_info(901, 900, 40),  # its CRIU
        proc_info(1000, 1, 20),
        proc_info(1001, 1000, 20),
    ]
    trees = build_trees(procs, frozenset({900, 901}))
    all_pids = {pid for t in trees for pid in t.pids}
    assert all_pids == {1000, 1001}
    assert _by_root(trees) == {1000: (1000, 1001)}


def test_build_trees_children_attach_to_parent() -> None:
    procs = [
        proc_info(10, 1), proc_info(11, 10), proc_info(12, 10), proc_info(13, 11),
        proc_info(20, 1), proc_info(21, 20),
        proc_info(30, 999),  # parent outside the set: its own root
    ]
    assert _by_root(build_trees(procs, NONE)) == {
        10: (10, 11, 12, 13), 20: (20, 21), 30: (30,)}


def test_build_trees_members_breadth_first_sorted_by_pid() -> None:
    # Input order shuffled; within a level children come by pid; parents before children.
    procs = [proc_info(13, 12), proc_info(12, 10), proc_info(14, 10), proc_info(11, 10),
             proc_info(10, 1), proc_info(15, 11)]
    [tree] = build_trees(procs, NONE)
    assert tree.pids == (10, 11, 12, 14, 15, 13)
    assert tree.root.pid == 10
    assert tree.members[0] is tree.root


def test_build_trees_child_of_protected_is_root() -> None:
    procs = [proc_info(900, 1), proc_info(950, 900, 100), proc_info(951, 950, 1)]
    assert _by_root(build_trees(procs, frozenset({900}))) == {950: (950, 951)}


def test_build_trees_pidns_init_roots_own_tree() -> None:
    procs = [
        proc_info(5000, 4100, 1, comm="unshare"),
        proc_info(5001, 5000, 64, nspid=(5001, 1)),  # init of a nested namespace
        proc_info(5002, 5001, 32, nspid=(5002, 2)),
        proc_info(5003, 5002, 16, nspid=(5003, 3)),
        proc_info(4100, 1, 2, comm="bash"),
    ]
    trees = _by_root(build_trees(procs, NONE))
    assert trees == {4100: (4100, 5000), 5001: (5001, 5002, 5003)}


def test_build_trees_doubly_nested_init() -> None:
    # NSpid (6001, 7, 1): init of a namespace nested two deep, child of a pidns init.
    procs = [proc_info(6000, 1, nspid=(6000, 1)), proc_info(6001, 6000, nspid=(6001, 7, 1)),
             proc_info(6002, 6000, nspid=(6002, 8))]
    assert _by_root(build_trees(procs, NONE)) == {6000: (6000, 6002), 6001: (6001,)}


def test_build_trees_nspid_ending_in_1_but_length_1_is_not_init() -> None:
    # Host PID 1 is protected anyway; a single-element NSpid is the host namespace.
    procs = [proc_info(70, 1), proc_info(71, 70, nspid=(71,))]
    assert _by_root(build_trees(procs, NONE)) == {70: (70, 71)}


def test_build_trees_empty() -> None:
    assert build_trees([], NONE) == []
    assert build_trees([proc_info(1, 0)], NONE) == []


def test_tree_rss_is_sum() -> None:
    procs = [proc_info(10, 1, 100), proc_info(11, 10, 50), proc_info(12, 11, 25)]
    [tree] = build_trees(procs, NONE)
    assert tree.rss_bytes == 175 * MiB


# -- rank_victims --------------------------------------------------------------------------------

def test_rank_by_tree_rss_not_process_rss() -> None:
    procs = [
        proc_info(10, 1, 300),  # biggest single process, alone
        proc_info(20, 1, 100), proc_info(21, 20, 150), proc_info(22, 20, 100),  # 350 in total
        proc_info(30, 1, 5),
    ]
    ranked = rank_victims(build_trees(procs, NONE))
    assert [t.root.pid for t in ranked] == [20, 10, 30]
    assert [t.rss_bytes // MiB for t in ranked] == [350, 300, 5]


@pytest.mark.parametrize(
    ("specs", "order"),
    [
        # (pid, rss_mib, starttime): equal RSS -> the newer (larger starttime) first
        ([(10, 100, 500), (20, 100, 900)], [20, 10]),
        ([(20, 100, 900), (10, 100, 500)], [20, 10]),
        # equal RSS and starttime -> lower pid first (deterministic)
        ([(20, 100, 500), (10, 100, 500)], [10, 20]),
        # RSS dominates age
        ([(10, 101, 1), (20, 100, 900)], [10, 20]),
        ([(10, 0, 1), (20, 0, 2), (30, 0, 3)], [30, 20, 10]),
    ],
    ids=["newer-first", "newer-first-reordered", "pid-tiebreak", "rss-dominates", "all-zero"],
)
def test_rank_ties(specs: list[tuple[int, int, int]], order: list[int]) -> None:
    trees = build_trees([proc_info(pid, 1, rss, starttime=st) for pid, rss, st in specs], NONE)
    assert [t.root.pid for t in rank_victims(trees)] == order


def test_rank_empty() -> None:
    assert rank_victims([]) == []


# -- headroom_needed -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("usage", "limit", "headroom", "expected"),
    [
        (900, None, 64, None),  # no limit: nothing to raise
        (100, 1000, 64, None),  # plenty of room
        (936, 1000, 64, None),  # exactly enough room
        (937, 1000, 64, 937 + 64),  # one byte short
        (1000, 1000, 64, 1064),  # at the limit
        (1010, 1000, 64, 1074),  # above the limit (v1 can overshoot briefly)
        (1000, 1000, 0, None),  # no headroom wanted
    ],
    ids=["no-limit", "room", "exact", "short", "at-limit", "over-limit", "zero-headroom"],
)
def test_headroom_needed(usage: int, limit: int | None, headroom: int, expected: int | None) -> None:
    s = MemorySnapshot(usage_bytes=usage, limit_bytes=limit, anon_bytes=usage, file_bytes=0,
                       oom_kills=0, under_oom=False)
    assert headroom_needed(s, headroom) == expected


def test_exiting_tasks_are_never_victims() -> None:
    from dataclasses import replace

    from oomguard.policy.victims import build_trees
    from tests.unit._support import proc_info

    alive = proc_info(500, 1, rss_mib=50)
    zombie = replace(proc_info(501, 1, rss_mib=0), state="Z")
    released = replace(proc_info(502, 1, rss_mib=0), cmdline=())
    trees = build_trees([alive, zombie, released], frozenset())
    assert [t.root.pid for t in trees] == [500]


# -- next_watch_look: a cache-only crossing confirmed as resident memory catches up ------------

def test_watch_look_reads_again_at_once_after_the_crossing() -> None:
    from oomguard.policy.pressure import WATCH_FIRST_S, next_watch_look
    look = next_watch_look(10.0, 100 * MiB, 128 * MiB, None, 0.0, 0.1)
    assert look.delay == WATCH_FIRST_S and look.idle_interval == 0.0


@pytest.mark.parametrize(("rate_mb_s", "gap_mib"), [(100, 4), (500, 4), (2000, 4), (100, 0.5)])
def test_watch_look_is_half_the_way_to_the_mark_at_the_growth_seen(rate_mb_s: int,
                                                                    gap_mib: float) -> None:
    from oomguard.policy.pressure import WATCH_MIN_S, next_watch_look
    mark = 128 * MiB
    resident = int(mark - gap_mib * MiB)
    growth = rate_mb_s * 1e6
    before = (9.99, int(resident - growth * 0.01))
    look = next_watch_look(10.0, resident, mark, before, 0.0, 0.1)
    eta = gap_mib * MiB / growth
    assert look.delay == pytest.approx(min(0.1, max(WATCH_MIN_S, eta / 2)), rel=1e-6)
    assert look.idle_interval == 0.0


def test_watch_look_backs_off_while_nothing_grows_and_comes_back_when_it_does() -> None:
    from oomguard.policy.pressure import WATCH_MAX_S, next_watch_look
    mark, resident = 128 * MiB, 60 * MiB  # a cgroup full of page cache, resident flat
    interval, delays = 0.0, []
    for step in range(8):
        look = next_watch_look(10.0 + step, resident, mark, (9.0 + step, resident), interval, 0.1)
        interval = look.idle_interval
        delays.append(round(look.delay, 3))
    assert delays == [0.1, 0.2, 0.4, 0.8, WATCH_MAX_S, WATCH_MAX_S, WATCH_MAX_S, WATCH_MAX_S]
    growing = next_watch_look(20.0, resident + 50 * MiB, mark, (19.0, resident), interval, 0.1)
    assert growing.idle_interval == 0.0 and growing.delay <= 0.1


# -- a wake-up by the kernel measures the growth afresh; reclaim at the limit ------------------

def test_a_wake_up_drops_a_stale_reading_so_the_growth_is_measured_as_it_is_now() -> None:
    from oomguard.policy.pressure import (
        WATCH_FIRST_S,
        WATCH_STALE_S,
        next_watch_look,
        watch_baseline,
    )
    mark = 163 * MiB
    quiet = (10.0, 142 * MiB)  # read a second ago, before a job began growing at 1000 MB/s
    now, resident = 11.0, 150 * MiB
    # Against the old reading the growth looks like 8 MiB/s: the next look would be 0.1 s
    # away, where the job reaches the limit in 40 ms.
    assert next_watch_look(now, resident, mark, quiet, 1.0, 0.1).delay == 0.1
    fresh = watch_baseline(quiet, now, woken=True)
    assert fresh is None
    assert next_watch_look(now, resident, mark, fresh, 1.0, 0.1).delay == WATCH_FIRST_S
    recent = (now - WATCH_STALE_S / 2, 149 * MiB)
    assert watch_baseline(recent, now, woken=True) == recent
    assert watch_baseline(quiet, now, woken=False) == quiet  # a poll keeps its baseline


def _snap(usage: int, resident: int, limit: int | None = 192 * MiB) -> MemorySnapshot:
    return MemorySnapshot(usage_bytes=usage, limit_bytes=limit, anon_bytes=resident,
                          file_bytes=usage - resident, oom_kills=0, under_oom=False)


def test_reclaim_room_is_the_way_to_the_threshold_less_the_free_room() -> None:
    from oomguard.policy.pressure import reclaim_room
    threshold_mib = 0.85 * 192  # 163.2 MiB
    # Full of page cache, 40 MiB resident: 123.2 MiB to go, all of it through reclaim.
    assert reclaim_room(_snap(192 * MiB, 40 * MiB), 0.85) == int(threshold_mib * MiB) - 40 * MiB
    # 20 MiB free under the limit: that much can grow with no reclaim at all.
    assert reclaim_room(_snap(172 * MiB, 40 * MiB), 0.85) == \
        int(threshold_mib * MiB) - 40 * MiB - 20 * MiB
    # Little cache: the free room alone reaches the threshold; at or over it; no limit.
    assert reclaim_room(_snap(150 * MiB, 145 * MiB), 0.85) == 0
    assert reclaim_room(_snap(192 * MiB, 170 * MiB), 0.85) == 0
    assert reclaim_room(_snap(192 * MiB, 40 * MiB, limit=None), 0.85) == 0


def test_reclaim_wakes_look_before_resident_memory_is_half_way() -> None:
    from oomguard.cgroup.v1 import RECLAIM_WINDOW_BYTES as window
    from oomguard.policy.pressure import reclaim_due
    room = 40 * MiB  # 20 windows of 2 MiB
    looks = [events for events in range(1, 30) if reclaim_due(events, room, window)]
    assert looks[0] == 9  # (9 + 1) x 2 MiB = 20 MiB: half way, at the most
    assert all(reclaim_due(n, 0, window) for n in (0, 1, 5))  # nothing to count: every wake
