"""How a memory cgroup is watched, one interface for cgroup v1 and v2: the daemon asks what a
cgroup offers (usage crossings, a setting to replace, parking at the limit, a whole-cgroup
freeze) and never which version it has; a new backend is a new branch here, not in the loop.

v1: eventfd usage thresholds and the OOM notification (cgroup.event_control), with
oom_kill_disable so that a task reaching the limit waits instead of being killed. v2: has no
usage thresholds: memory.high at the threshold (the kernel throttles there and counts a `high`
event in memory.events, which wakes the daemon), a PSI trigger, and cgroup.freeze.
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from oomguard.cgroup.base import FreezableCgroup, MemoryCgroup
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup, rearm_watch
from oomguard.config.schema import GuardConfig
from oomguard.detect.registry import watched_from
from oomguard.model.errors import CgroupGone
from oomguard.model.pressure import parse_pressure

EVENTFD, KERNFS, PSI = "eventfd", "kernfs", "psi"
RECLAIM = "reclaim"  # v1 vmpressure: an eventfd that counts the cgroup's reclaim windows
EPOLL_MASK = {EVENTFD: select.EPOLLIN, KERNFS: select.EPOLLPRI, PSI: select.EPOLLPRI,
              RECLAIM: select.EPOLLIN}
OOM_KILL_KEY = "#oom_kill_disable"  # SavedLimits key suffix: the cgroup's path + this
# Sixteenths of the way from the threshold to the limit. Each v1 registration costs the
# kernel an RCU grace period (~8 ms here): three marks keep a 1000-cgroup start near 25 s.
MARK_STEPS = (0, 1, 8)


@dataclass(slots=True)
class Replaced:
    """What oomguard changed on a cgroup to watch it, whatever its version, to be put back
    when the guard lets go: v1 oom_kill_disable, v2 memory.high. Only this module reads or
    writes it; the guard holds it (guards.CgroupGuard.replaced)."""

    high_set: bool = False  # v2: `high` events come at (or before) the threshold
    high_changed: bool = False  # ...because oomguard lowered memory.high
    high_original: int | None = None
    high_yielded: bool = False  # v2: given up to another writer that keeps taking it back
    oom_disable_changed: bool = False  # v1: oomguard set oom_kill_disable
    oom_disable_original: bool = False


class Watched(Protocol):
    """What of a guard the watch reads and writes (guards.CgroupGuard)."""

    spec: GuardConfig
    cgroup: MemoryCgroup
    fds: dict[int, str]
    detection: str
    replaced: Replaced

    @property
    def name(self) -> str: ...


@dataclass
class Setting:
    """The setting oomguard replaces to watch a cgroup (v1 oom_kill_disable, v2 memory.high):
    its value as found, and whether oomguard changes it (the original is saved first, under
    saved_key)."""

    now: int | None = None
    change: bool = False


def threshold_marks(limit: int, threshold: float) -> list[int]:
    """Usage levels to be told about: the threshold, then 1/16 and 1/2 of the way from it to
    the limit. A crossing that is page cache rather than resident memory is watched (polled);
    the marks that follow wake the daemon again as soon as resident memory catches up."""
    first = limit * threshold
    step = (limit - first) / 16
    return sorted({min(limit, int(first + k * step)) for k in MARK_STEPS})


def v1_marks(guard: Watched, limit: int) -> tuple[list[int], list[int]]:
    """The usage levels to register on v1, as (first, later): first the threshold itself (and
    where a detection plug-in starts watching: time_to_limit's growth), which make the guard
    armed; then the marks beyond the threshold, which only catch up with page cache."""
    marks = threshold_marks(limit, guard.spec.threshold)
    first = marks[:1]
    for share in watched_from(guard.spec.signal_settings()):  # where a plug-in starts watching
        first.insert(0, int(limit * share))
    return first, marks[1:]


# -- what a cgroup offers ------------------------------------------------------------------------

def reports_crossings(guard: Watched) -> bool:
    """The kernel says when usage crosses the threshold: v1 marks always; v2 only through
    memory.high at the threshold (else the guard is polled)."""
    return not isinstance(guard.cgroup, V2MemoryCgroup) or guard.replaced.high_set


def parks_at_limit(guard: Watched) -> V1MemoryCgroup | None:
    """The cgroup, where its tasks at the limit wait instead of being killed because oomguard
    set it so (v1 oom_kill_disable, which the park watchdog then looks after)."""
    cgroup = guard.cgroup
    if isinstance(cgroup, V1MemoryCgroup) and guard.replaced.oom_disable_changed \
            and not guard.replaced.oom_disable_original:
        return cgroup
    return None


def freezable(cgroup: MemoryCgroup) -> FreezableCgroup | None:
    """The cgroup, where the whole of it can be frozen at once (v2 cgroup.freeze)."""
    return cgroup if isinstance(cgroup, V2MemoryCgroup) else None


def shields_needed(cgroup: MemoryCgroup | None) -> bool:
    """Until its tree has stopped, a victim needs oom_score_adj's shield: v2 has no
    oom_kill_disable (v1's keeps a task at the limit waiting instead)."""
    return isinstance(cgroup, V2MemoryCgroup)


def pressure_avg10(cgroup: MemoryCgroup) -> float | None:
    """The cgroup's memory pressure (PSI some avg10) where it has its own (v2), else None."""
    if not isinstance(cgroup, V2MemoryCgroup):
        return None
    try:
        return parse_pressure((cgroup.path / "memory.pressure").read_text()).some.avg10
    except (OSError, ValueError):
        return None


# -- arming ----------------------------------------------------------------------------------

def saved_key(guard: Watched) -> str:
    return guard.name + (OOM_KILL_KEY if isinstance(guard.cgroup, V1MemoryCgroup) else "")


def read_setting(guard: Watched, limit: int, dry_run: bool, ours: bool = False) -> Setting:
    """The setting as found, and whether arming replaces it (`ours`: oomguard replaced it
    before and keeps the user's original: a memory.high it set for an older limit is moved to
    the new threshold). Raises OSError, CgroupGone."""
    found = Setting()
    cgroup = guard.cgroup
    if isinstance(cgroup, V1MemoryCgroup):
        if guard.spec.oom_kill_disable and not dry_run:  # nothing acts in a dry run
            found.now = int(cgroup.oom_kill_disabled())
            found.change = True
    elif isinstance(cgroup, V2MemoryCgroup) and guard.spec.memory_high \
            and not guard.replaced.high_yielded:
        found.now = cgroup.high()
        found.change = ours or high_to_set(guard, limit, found.now)
    return found


def arm_first(guard: Watched, limit: int, change: bool, original: int | None,
              psi_trigger: str) -> bool:
    """What makes the guard armed: v1 the threshold mark, the OOM notification and
    oom_kill_disable; v2 memory.high, memory.events and PSI. Returns whether later marks
    follow (register_later). Raises OSError, CgroupGone."""
    cgroup = guard.cgroup
    if isinstance(cgroup, V1MemoryCgroup):
        first, _later = v1_marks(guard, limit)
        for mark in first:
            guard.fds[cgroup.register_threshold(mark)] = EVENTFD
        guard.fds[cgroup.register_oom()] = EVENTFD
        guard.detection = "v1 memory threshold eventfd + OOM notification"
        # Usage pinned at the limit (page cache reclaimed as resident memory grows) crosses no
        # mark: the kernel's reclaim there wakes the daemon instead (cheap: no RCU wait).
        with contextlib.suppress(OSError, CgroupGone):
            guard.fds[cgroup.register_pressure()] = RECLAIM
            guard.detection += " + reclaim (vmpressure)"
        if change:
            disable_oom_kill(guard, cgroup, original)
        return True
    if isinstance(cgroup, V2MemoryCgroup):
        set_high_at_threshold(guard, cgroup, limit, change, original)
        arm_v2(guard, psi_trigger)
    return False  # v2 has no usage thresholds, so no later marks


def register_later(guard: Watched, limit: int) -> list[int]:
    """The v1 marks beyond the threshold, registered; their eventfds are returned, not added
    to the guard (this runs beside the loop, after the guard is armed: each registration
    waits for an RCU grace period). Raises OSError, CgroupGone, with none left open."""
    assert isinstance(guard.cgroup, V1MemoryCgroup)
    fds: list[int] = []
    try:
        for mark in v1_marks(guard, limit)[1]:
            fds.append(guard.cgroup.register_threshold(mark))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def arm_v2(guard: Watched, psi_trigger: str) -> None:
    """Registers memory.events and PSI watches, and says them in guard.detection."""
    assert isinstance(guard.cgroup, V2MemoryCgroup)
    paths = []
    guard.fds[guard.cgroup.open_events_watch()] = KERNFS
    paths.append("memory.events")
    if guard.replaced.high_set:
        paths.insert(0, f"memory.high at {guard.spec.threshold:.0%}")
    if guard.spec.psi:
        try:
            guard.fds[guard.cgroup.open_psi_trigger(psi_trigger)] = PSI
            paths.append(f"PSI '{psi_trigger}'")
        except (OSError, ValueError):
            pass
    guard.detection = " + ".join(paths)


def consume(fd: int, kind: str) -> int:
    """Reset an fd after it woke us, so it does not report ready again for the same event;
    returns how many events it had counted (1 where it does not count)."""
    with contextlib.suppress(BlockingIOError, OSError):
        if kind in (EVENTFD, RECLAIM):
            return int.from_bytes(os.read(fd, 8), "little")
        if kind == KERNFS:
            rearm_watch(fd)
    return 1


def high_to_set(guard: Watched, limit: int, current: int | None) -> bool:
    """Whether arming sets memory.high at the threshold: a memory.high the user set at or
    below it already throttles there (and wakes us), and is left alone."""
    return guard.spec.memory_high and not (
        current is not None and current <= int(limit * guard.spec.threshold))


def replaced_setting_file(guard: Watched) -> Path | None:
    """The file of the setting oomguard lowered to watch the cgroup, where another writer
    could take it back (v2 memory.high); None where there is none."""
    cgroup = guard.cgroup
    if isinstance(cgroup, V2MemoryCgroup) and guard.replaced.high_changed:
        return cgroup.path / "memory.high"
    return None


def high_taken_back(guard: Watched, limit: int) -> int | None:
    """memory.high as another writer left it, where it no longer throttles at the threshold
    oomguard set it to (a job scheduler that writes its own after the cgroup was armed: Slurm's
    task/cgroup sets memory.high to the job's limit; systemd's MemoryHigh=); None where it
    still does, or was never oomguard's. "max" reads as `limit`. Arming again sets it back
    (oomguard's put back then restores the other writer's value)."""
    cgroup = guard.cgroup
    if not isinstance(cgroup, V2MemoryCgroup) or not guard.replaced.high_changed:
        return None
    try:
        now = cgroup.high()
    except (OSError, CgroupGone):
        return None
    value = limit if now is None else now
    return value if value > int(limit * guard.spec.threshold) else None


def yield_high(guard: Watched) -> None:
    """Give memory.high up to another writer that keeps taking it back (a tug of war is
    worse than either value): arming no longer sets it, theirs stands with nothing of
    oomguard's to put back, and the guard is polled (reports_crossings is False). Until the
    guard lets go of the cgroup (put_back)."""
    guard.replaced = Replaced(high_yielded=True)


def set_high_at_threshold(guard: Watched, cgroup: V2MemoryCgroup, limit: int,
                          change: bool, original: int | None) -> None:
    """memory.high at the threshold: the kernel throttles there and counts a `high` event,
    which wakes us exactly at the crossing (v2 has no usage thresholds). `original` was
    saved (SavedLimits) before this is called."""
    if not guard.spec.memory_high or guard.replaced.high_yielded:
        return
    guard.replaced.high_set = True
    if not change:
        return
    cgroup.set_high(int(limit * guard.spec.threshold))
    guard.replaced.high_original = original
    guard.replaced.high_changed = True


def disable_oom_kill(guard: Watched, cgroup: V1MemoryCgroup, original: int | None) -> None:
    """v1 `oom_kill_disable` (the default): a task that reaches the limit before oomguard has
    stopped it (memory taken inside one system call, which no SIGSTOP interrupts) waits instead
    of being killed; its OOM event wakes the daemon, which stops it, lifts the limit a little
    and dumps it. Put back when the guard stops (and after a crash, at start). `original` was
    saved (SavedLimits, key name + OOM_KILL_KEY) before this is called."""
    if not guard.spec.oom_kill_disable:
        return
    cgroup.set_oom_kill_disable(True)
    guard.replaced.oom_disable_original = bool(original)
    guard.replaced.oom_disable_changed = True


# -- putting back ------------------------------------------------------------------------------

def put_back(guard: Watched) -> list[str]:
    """The replaced settings as they were; returns the SavedLimits keys to forget (the caller
    forgets many in one write)."""
    key = claimed_key(guard)
    if guard.replaced.high_changed and isinstance(guard.cgroup, V2MemoryCgroup):
        with contextlib.suppress(OSError, CgroupGone):
            guard.cgroup.set_high(guard.replaced.high_original)
    if guard.replaced.oom_disable_changed and isinstance(guard.cgroup, V1MemoryCgroup):
        with contextlib.suppress(OSError, CgroupGone):
            guard.cgroup.set_oom_kill_disable(guard.replaced.oom_disable_original)
    guard.replaced = Replaced()
    return [key] if key is not None else []


def claimed_key(guard: Watched) -> str | None:
    """The SavedLimits key an armed guard holds (its original stays saved), if any."""
    return saved_key(guard) if guard.replaced.high_changed or guard.replaced.oom_disable_changed else None


def put_back_saved(cgroup: MemoryCgroup, key: str, original: int | None) -> str | None:
    """After a crash: a saved original put back on its cgroup; what was put back, in words
    (None where the key is not this cgroup's kind). Raises OSError, CgroupGone."""
    if key.endswith(OOM_KILL_KEY) and isinstance(cgroup, V1MemoryCgroup):
        cgroup.set_oom_kill_disable(bool(original))
        return f"oom_kill_disable {int(bool(original))}"
    if not key.endswith(OOM_KILL_KEY) and isinstance(cgroup, V2MemoryCgroup):
        cgroup.set_high(original)
        return f"memory.high {'max' if original is None else original}"
    return None
