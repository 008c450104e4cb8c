"""A cgroup guard's look as one pure function: the history a guard carries from look to look
(GuardHistory: its cache-only watch, the detection plug-ins' states, the reclaim counted since)
and one reading go in; the decision (act or not, why, the next look) and the history for the
next look come out, as systemd-oomd passes the previous tick's data. The daemon's examiner
reads the sensors, keeps what comes back and acts on it (oomguard/daemon/examining.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from oomguard.cgroup.base import MemorySnapshot
from oomguard.detect.base import CgroupSignal, Settings
from oomguard.detect.registry import after_action, judge_cgroup, polling
from oomguard.policy.pressure import (
    CacheWatch,
    Verdict,
    evaluate,
    reclaim_due,
    reclaim_room,
    watch_next,
)

PARKED_RETRY = 2.0  # v1: tasks wait at the limit and nothing acted yet: look again this soon


def _no_states() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class GuardHistory:
    """What a cgroup guard carries from one look to the next (a new value each look)."""

    watching: bool = False  # the last look was a cache-only watch (Verdict.WATCH)
    cache_watch: CacheWatch = field(default_factory=CacheWatch)  # pressure.watch_next
    # What each cgroup detection plug-in kept from its last look (oomguard.detect: by name).
    signal_states: Mapping[str, Any] = field(default_factory=_no_states)
    reclaim_room: int = 0  # reclaim needed for resident memory to reach the threshold, at the last look
    reclaim_events: int = 0  # the kernel's reclaim windows counted since (watch.RECLAIM)


@dataclass(frozen=True)
class CgroupLook:
    """One look at a guarded cgroup, as the cgroup detection plug-ins read it
    (oomguard.detect.base.CgroupReadings)."""

    snapshot: MemorySnapshot
    now: float
    dump_throughput: float

    @property
    def usage_bytes(self) -> int:
        return self.snapshot.usage_bytes

    @property
    def anon_bytes(self) -> int:
        return self.snapshot.anon_bytes

    @property
    def limit_bytes(self) -> int | None:
        return self.snapshot.limit_bytes


@dataclass(frozen=True)
class LookDecision:
    """What one look decided."""

    verdict: Verdict  # the threshold's (pressure.evaluate)
    reason: str | None  # why the rule acts now (the threshold's or a plug-in's); None: it does not
    fired: CgroupSignal | None  # the plug-in whose reason it is (None: the threshold's, or none)
    watch_started: bool  # a cache-only watch began at this look (threshold.cache_only)
    due_at: float | None  # look again then without an event (None: on events only)

    @property
    def over_threshold(self) -> bool:
        return self.verdict is Verdict.ACT


def look_at_cgroup(history: GuardHistory, look: CgroupLook, threshold: float,
                   settings: Settings, *, poll_interval: float, woken: bool,
                   poll_only: bool) -> tuple[LookDecision, GuardHistory]:
    """The threshold first (pressure.evaluate); below it the detection plug-ins judge the look
    (each from its state of the last look); then the next look is scheduled from the states
    they gave back; a rule that acts over the threshold gives its plug-ins after_action's
    states. `woken`: the kernel woke the daemon for this look (a cache-only watch measures its
    growth afresh). The reclaim counted since the last look starts again from 0."""
    snap = look.snapshot
    evaluated = evaluate(snap, threshold)
    over = evaluated.verdict is Verdict.ACT
    watching = evaluated.verdict is Verdict.WATCH
    reason: str | None = evaluated.reason
    fired: CgroupSignal | None = None
    states = history.signal_states
    if not over:
        fired, reason, judged = judge_cgroup(look, settings, states)
        states = MappingProxyType(judged)
    judged_history = replace(history, watching=watching, signal_states=states,
                             reclaim_room=reclaim_room(snap, threshold), reclaim_events=0)
    due, cache_watch = _next_look(judged_history, look, threshold, woken=woken,
                                  poll_interval=poll_interval, poll_only=poll_only)
    if over:
        states = MappingProxyType(after_action(states))
    if reason is not None and snap.under_oom:  # parked at the limit: never left waiting
        due = min(due or 1e18, look.now + PARKED_RETRY)
    decision = LookDecision(evaluated.verdict, reason, fired,
                            watch_started=watching and not history.watching, due_at=due)
    return decision, replace(judged_history, cache_watch=cache_watch, signal_states=states)


def _next_look(history: GuardHistory, look: CgroupLook, threshold: float, *, woken: bool,
               poll_interval: float, poll_only: bool) -> tuple[float | None, CacheWatch]:
    """When to look again without an event, and the cache-only watch's history: a cache-only
    watch follows the growth of resident memory (measured afresh after a wake-up by the
    kernel); time-to-limit and polled guards every poll_interval. `history`: this look's
    watching and plug-in states, the last look's cache-only watch."""
    now, snap = look.now, look.snapshot
    due: float | None = None
    if poll_only or polling(history.signal_states):
        due = now + poll_interval
    if not history.watching or snap.limit_bytes is None:
        return due, CacheWatch()
    delay, cache_watch = watch_next(history.cache_watch, now, snap.unreclaimable_bytes,
                                    snap.limit_bytes * threshold, woken, poll_interval)
    return min(due or 1e18, now + delay), cache_watch


def reclaim_counted(history: GuardHistory, events: int,
                    window_bytes: int) -> tuple[bool, GuardHistory]:
    """The kernel's reclaim in the cgroup woke the daemon (`events` windows of at most
    `window_bytes`): whether to look now (pressure.reclaim_due, on every window counted since
    the last look), and the history with them counted."""
    counted = replace(history, reclaim_events=history.reclaim_events + events)
    return reclaim_due(counted.reclaim_events, counted.reclaim_room, window_bytes), counted
