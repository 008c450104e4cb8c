"""Pressure decisions: a cgroup against its threshold, when to look again at one whose usage is
page cache, a system below its floor, the headroom a dump needs, whether a restore fits.
Pure functions of a snapshot, the rule and the time; no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from oomguard.cgroup.base import MemorySnapshot
from oomguard.model.units import format_size


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
WATCH_STALE_S = 0.05  # a reading older than this says nothing of the growth a wake-up reports


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


def watch_baseline(previous: tuple[float, int] | None, now: float,
                   woken: bool) -> tuple[float, int] | None:
    """The reading a cache-only watch measures growth from. After a wake-up by the kernel (a
    mark crossed, reclaim at the limit) one older than WATCH_STALE_S is dropped: the next look
    then comes WATCH_FIRST_S later and measures the growth as it is now. (A job that starts
    growing fast after a quiet spell, which backed the watch off, would otherwise be measured
    against a reading from before the spell: its growth averaged down, the next look due too
    late, the limit reached in between.)"""
    if woken and previous is not None and now - previous[0] > WATCH_STALE_S:
        return None
    return previous


@dataclass(frozen=True)
class CacheWatch:
    """A cache-only watch's history, taken and returned by watch_next."""

    sample: tuple[float, int] | None = None  # (when, resident) at the last watch look
    interval: float = 0.0  # the watch's current interval while resident memory does not grow


def watch_next(history: CacheWatch, now: float, resident: int, mark: float, woken: bool,
               poll_interval: float) -> tuple[float, CacheWatch]:
    """Seconds until the cache-only watch looks again (next_watch_look, from the reading
    watch_baseline keeps), and its history with this reading."""
    look = next_watch_look(now, resident, mark, watch_baseline(history.sample, now, woken),
                           history.interval, poll_interval)
    return look.delay, CacheWatch((now, resident), look.idle_interval)


def reclaim_room(snapshot: MemorySnapshot, threshold: float) -> int:
    """How much the kernel must reclaim in the cgroup before resident memory can reach the
    threshold: the way there, less the free room under the limit (which it can grow into
    without any reclaim). 0 at or over the threshold, when the free room alone reaches it, or
    without a limit."""
    limit = snapshot.limit_bytes
    if limit is None:
        return 0
    to_threshold = int(threshold * limit) - snapshot.unreclaimable_bytes
    return max(0, to_threshold - max(0, limit - snapshot.usage_bytes))


def reclaim_due(events: int, room: int, window_bytes: int) -> bool:
    """Whether `events` of the kernel's reclaim windows since the last look (`room` from
    reclaim_room then) call for another look. A window reclaims at most `window_bytes`, so the
    look comes before resident memory can be more than half way to the threshold: a cgroup full
    of page cache that is being read through (reclaim all the time, nothing resident growing)
    costs a read every room / (2 x window) events, not one each."""
    return (events + 1) * window_bytes * 2 >= room


def headroom_needed(snapshot: MemorySnapshot, headroom: int) -> int | None:
    """The raised limit that gives the frozen tree `headroom` bytes to be seized and dumped
    (a task stuck at the limit cannot be; the parasite charges memory to the victim), or None."""
    if snapshot.limit_bytes is None:
        return None
    if snapshot.limit_bytes - snapshot.usage_bytes >= headroom:
        return None
    return snapshot.usage_bytes + headroom


def free_under_threshold(snapshot: MemorySnapshot, threshold: float) -> int | None:
    """Bytes between resident memory and the rule's threshold (negative when over it); None
    without a limit (everything fits). Page cache is not in the way: the kernel drops it for
    what comes, and the guard itself acts on resident memory, not on cache (a cgroup whose
    jobs wrote files sits near its limit in cache for good, and a restore never fitted)."""
    if snapshot.limit_bytes is None:
        return None
    return int(threshold * snapshot.limit_bytes) - snapshot.unreclaimable_bytes


def restore_fits(snapshot: MemorySnapshot, image_bytes: int, margin: int,
                 threshold: float) -> bool:
    """A checkpoint goes back (auto-restore, or `oomguard restore` into a guarded cgroup) only
    when it fits with room to spare: resident memory (usage less the page cache the kernel
    reclaims) plus the image plus a margin stays under the threshold, so a restore never lands
    straight back in the pressure that caused the checkpoint (hysteresis)."""
    free = free_under_threshold(snapshot, threshold)
    return free is None or image_bytes + margin <= free
