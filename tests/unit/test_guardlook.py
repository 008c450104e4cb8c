"""A cgroup guard's look as a pure function (issue 30, item 4: state carried explicitly): the
history goes in, the decision and the next history come out, the one given is never changed."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from oomguard.cgroup.base import MemorySnapshot
from oomguard.detect import registry
from oomguard.detect.timetolimit import GrowthHistory
from oomguard.policy.guardlook import (
    PARKED_RETRY,
    CgroupLook,
    GuardHistory,
    look_at_cgroup,
    reclaim_counted,
)
from oomguard.policy.pressure import WATCH_FIRST_S, WATCH_MAX_S, CacheWatch, Verdict

MiB = 1 << 20
LIMIT = 192 * MiB
THRESHOLD = 0.85  # 163.2 MiB
POLL = 1.0
THROUGHPUT = 200e6


def _snap(usage: int, resident: int, under_oom: bool = False) -> MemorySnapshot:
    return MemorySnapshot(usage_bytes=usage, limit_bytes=LIMIT, anon_bytes=resident,
                          file_bytes=usage - resident, oom_kills=0, under_oom=under_oom)


def _settings(time_to_limit: bool = False) -> dict[str, Any]:
    return {**registry.defaults(), "time_to_limit": time_to_limit, "predict_from": 0.5}


def _look(history: GuardHistory, snap: MemorySnapshot, now: float, *, woken: bool = False,
          time_to_limit: bool = False, poll_only: bool = False) -> Any:
    return look_at_cgroup(history, CgroupLook(snap, now, THROUGHPUT), THRESHOLD,
                          _settings(time_to_limit), poll_interval=POLL, woken=woken,
                          poll_only=poll_only)


def test_a_look_over_the_threshold_acts_on_the_thresholds_reason() -> None:
    before = GuardHistory(reclaim_room=7 * MiB, reclaim_events=5)
    decision, after = _look(before, _snap(180 * MiB, 170 * MiB), 10.0)
    assert decision.verdict is Verdict.ACT and decision.over_threshold
    assert decision.reason == "resident 170.0MiB >= 85% of 192.0MiB"
    assert decision.fired is None and not decision.watch_started
    assert decision.due_at is None  # nothing polls, no watch: the kernel's events only
    assert after == GuardHistory(watching=False, cache_watch=CacheWatch(),
                                 signal_states={"time_to_limit": None},  # after_action's
                                 reclaim_room=0, reclaim_events=0)
    assert before == GuardHistory(reclaim_room=7 * MiB, reclaim_events=5)  # never changed


def test_over_the_threshold_the_plugins_are_not_judged_and_forget_their_growth() -> None:
    samples = ((9.0, 150 * MiB), (9.5, 160 * MiB))
    before = GuardHistory(signal_states={"time_to_limit": GrowthHistory(True, samples)})
    decision, after = _look(before, _snap(180 * MiB, 170 * MiB), 10.0, time_to_limit=True)
    assert decision.reason == "resident 170.0MiB >= 85% of 192.0MiB" and decision.fired is None
    # polled: the schedule saw the states before after_action (still predicting)
    assert decision.due_at == 10.0 + POLL
    assert after.signal_states == {"time_to_limit": GrowthHistory(True, ())}


def test_a_cache_only_watch_starts_then_follows_the_growth_then_ends() -> None:
    decision, first = _look(GuardHistory(), _snap(180 * MiB, 40 * MiB), 10.0)
    assert decision.verdict is Verdict.WATCH and decision.reason is None
    assert decision.watch_started and decision.due_at == 10.0 + WATCH_FIRST_S
    assert first.watching and first.cache_watch == CacheWatch((10.0, 40 * MiB), 0.0)

    now = 10.0 + WATCH_FIRST_S
    decision, second = _look(first, _snap(182 * MiB, 42 * MiB), now)
    assert decision.verdict is Verdict.WATCH and not decision.watch_started  # logged once
    growth = 2 * MiB / WATCH_FIRST_S  # 1000 MiB/s: half way to the mark at that rate
    assert decision.due_at == pytest.approx(now + (LIMIT * THRESHOLD - 42 * MiB) / growth / 2)
    assert second.cache_watch == CacheWatch((now, 42 * MiB), 0.0)

    decision, third = _look(second, _snap(100 * MiB, 42 * MiB), now + 1.0)
    assert decision.verdict is Verdict.IDLE and decision.due_at is None
    assert not third.watching and third.cache_watch == CacheWatch()


def test_a_wake_up_by_the_kernel_measures_a_cache_only_watch_afresh() -> None:
    watching = GuardHistory(watching=True, cache_watch=CacheWatch((10.0, 40 * MiB), 1.0))
    decision, after = _look(watching, _snap(182 * MiB, 60 * MiB), 12.0, woken=True)
    assert not decision.watch_started and decision.due_at == 12.0 + WATCH_FIRST_S
    assert after.cache_watch == CacheWatch((12.0, 60 * MiB), 0.0)
    # a due poll: growth from the old reading (none), backed off to WATCH_MAX_S
    decision, after = _look(watching, _snap(182 * MiB, 40 * MiB), 12.0)
    assert decision.due_at == 12.0 + WATCH_MAX_S
    assert after.cache_watch == CacheWatch((12.0, 40 * MiB), WATCH_MAX_S)


def test_a_plugin_state_is_carried_from_look_to_look_until_it_fires() -> None:
    decision, first = _look(GuardHistory(), _snap(120 * MiB, 100 * MiB), 0.0,
                            time_to_limit=True)
    assert decision.verdict is Verdict.IDLE and decision.reason is None
    assert decision.due_at == POLL  # over predict_from: polled
    assert first.signal_states == {"time_to_limit": GrowthHistory(True, ((0.0, 120 * MiB),))}

    decision, second = _look(first, _snap(150 * MiB, 130 * MiB), 0.1, time_to_limit=True)
    assert decision.verdict is Verdict.IDLE and decision.fired is not None
    assert decision.fired.name == "time_to_limit"
    assert decision.reason is not None and decision.reason.startswith("growing 300.0MiB/s")
    assert not decision.over_threshold and decision.due_at == 0.1 + POLL
    assert second.signal_states == {"time_to_limit": GrowthHistory(True, ())}
    assert first.signal_states["time_to_limit"].samples == ((0.0, 120 * MiB),)


def test_a_cgroup_parked_at_its_limit_is_looked_at_again_soon() -> None:
    decision, _ = _look(GuardHistory(), _snap(192 * MiB, 100 * MiB, under_oom=True), 5.0)
    assert decision.reason == "cgroup is under OOM" and decision.due_at == 5.0 + PARKED_RETRY
    decision, _ = _look(GuardHistory(), _snap(192 * MiB, 100 * MiB, under_oom=True), 5.0,
                        poll_only=True)
    assert decision.due_at == 5.0 + POLL  # the sooner of the poll and the retry


def test_each_look_measures_the_reclaim_room_and_counts_from_zero() -> None:
    before = GuardHistory(reclaim_room=1, reclaim_events=12)
    _, after = _look(before, _snap(LIMIT, 40 * MiB), 1.0)  # full, mostly page cache
    assert after.reclaim_room == int(THRESHOLD * LIMIT) - 40 * MiB and after.reclaim_events == 0


def test_reclaim_windows_are_counted_in_the_history_until_a_look_is_due() -> None:
    history = GuardHistory(reclaim_room=40 * MiB)
    window = 2 * MiB  # a look once 9 + 1 windows could have made 20 MiB resident
    dues = []
    for events in (4, 4, 1):
        due, history = reclaim_counted(history, events, window)
        dues.append((due, history.reclaim_events))
    assert dues == [(False, 4), (False, 8), (True, 9)]
    assert history.reclaim_room == 40 * MiB


def test_the_history_is_a_value() -> None:
    _, history = _look(GuardHistory(), _snap(120 * MiB, 100 * MiB), 0.0, time_to_limit=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        history.watching = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        history.signal_states["time_to_limit"] = None  # type: ignore[index]
