"""What the daemon watches, per rule: the kernel's notification fds for one cgroup (v1 eventfd
thresholds and OOM events; v2 memory.high events, memory.events changes and a PSI trigger) or
for the whole system (a PSI trigger on /proc/pressure/memory)."""

from __future__ import annotations

import contextlib
import os
import select
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup, rearm_watch
from oomguard.config import GuardConfig
from oomguard.errors import CgroupGone
from oomguard.ledger import SavedLimits
from oomguard.psi import has_cap_sys_resource, open_trigger, shortest_window_us, trigger_string
from oomguard.sense.cgroupfiles import Stamp

EVENTFD, KERNFS, PSI = "eventfd", "kernfs", "psi"
EPOLL_MASK = {EVENTFD: select.EPOLLIN, KERNFS: select.EPOLLPRI, PSI: select.EPOLLPRI}
PSI_STALL_SHARE = 10  # a trigger fires at 10% of the window stalled ("some")


@dataclass(slots=True)
class CgroupGuard:
    spec: GuardConfig
    cgroup: MemoryCgroup
    fds: dict[int, str] = field(default_factory=dict)
    armed_limit: int | None = None
    poll_only: bool = False
    watching: bool = False
    oom_kills: int = 0
    present: bool = True
    detection: str = ""
    high_original: int | None = None
    high_set: bool = False  # `high` events come at (or before) the threshold
    high_changed: bool = False  # ...because oomguard lowered memory.high (to be put back)
    oom_disable_changed: bool = False  # v1: oomguard set oom_kill_disable (to be put back)
    oom_disable_original: bool = False
    quiet_since: float | None = None  # auto-restore: since when the checkpoint would fit
    pattern: str = ""  # the glob this cgroup was found by, if any
    parts: Any = None  # the rule's compiled chain, preferences and settings (acting.RuleParts)
    predicting: bool = False  # time-to-limit: usage is in the zone where growth is watched
    # time-to-limit's recent (time, usage) readings; made only once usage enters its zone
    samples: deque[tuple[float, int]] | None = None
    last_snapshot: MemorySnapshot | None = None  # the latest reading (for the gauges)
    limit_stamp: Stamp | None = None  # the limit file when last read (the safety rescan)
    due_at: float | None = None  # look again then without an event (polls, a cache-only watch)
    watch_sample: tuple[float, int] | None = None  # (when, resident) at the last watch look
    watch_interval: float = 0.0  # the cache-only watch's current interval when not growing

    @property
    def name(self) -> str:
        return str(self.cgroup.path)


@dataclass(slots=True)
class SystemGuard:
    spec: GuardConfig
    fds: dict[int, str] = field(default_factory=dict)
    detection: str = ""
    watching: bool = False
    present: bool = True
    parts: Any = None
    predicting: bool = False

    @property
    def name(self) -> str:
        return "system"


Guard = CgroupGuard | SystemGuard


# Sixteenths of the way from the threshold to the limit. Each v1 registration costs the
# kernel an RCU grace period (~8 ms here): three marks keep a 1000-cgroup start near 25 s.
MARK_STEPS = (0, 1, 8)


def threshold_marks(limit: int, threshold: float) -> list[int]:
    """Usage levels to be told about: the threshold, then 1/16 and 1/2 of the way from it to
    the limit. A crossing that is page cache rather than resident memory is watched (polled);
    the marks that follow wake the daemon again as soon as resident memory catches up."""
    first = limit * threshold
    step = (limit - first) / 16
    return sorted({min(limit, int(first + k * step)) for k in MARK_STEPS})


def psi_trigger_for(proc_root: str = "/proc") -> str:
    """The fastest trigger this process may register: a 500 ms window with CAP_SYS_RESOURCE,
    else 2 s (the kernel's rule for unprivileged triggers)."""
    try:
        privileged = has_cap_sys_resource(Path(proc_root, "self", "status").read_text())
    except OSError:
        privileged = False
    window = shortest_window_us(privileged)
    return trigger_string("some", window // PSI_STALL_SHARE, window)


def v1_marks(guard: CgroupGuard, limit: int) -> tuple[list[int], list[int]]:
    """The usage levels to register on v1, as (first, later): first the threshold itself (and,
    with time_to_limit, the level where growth starts being watched), which make the guard
    armed; then the marks beyond the threshold, which only catch up with page cache."""
    marks = threshold_marks(limit, guard.spec.threshold)
    first = marks[:1]
    if guard.spec.time_to_limit:  # wake where growth starts being watched
        first.insert(0, int(limit * guard.spec.predict_from))
    return first, marks[1:]


def arm_v1_first(guard: CgroupGuard, limit: int) -> None:
    """The threshold mark and the OOM notification: from here on the guard is armed."""
    assert isinstance(guard.cgroup, V1MemoryCgroup)
    first, _later = v1_marks(guard, limit)
    for mark in first:
        guard.fds[guard.cgroup.register_threshold(mark)] = EVENTFD
    guard.fds[guard.cgroup.register_oom()] = EVENTFD
    guard.detection = "v1 memory threshold eventfd + OOM notification"


def arm_v1_later(guard: CgroupGuard, limit: int) -> None:
    """The marks beyond the threshold (each registration waits for an RCU grace period, so
    they come after every guard's first mark)."""
    assert isinstance(guard.cgroup, V1MemoryCgroup)
    for mark in v1_marks(guard, limit)[1]:
        guard.fds[guard.cgroup.register_threshold(mark)] = EVENTFD


def arm_v1(guard: CgroupGuard, limit: int) -> None:
    arm_v1_first(guard, limit)
    arm_v1_later(guard, limit)


def arm_v2(guard: CgroupGuard, limit: int, psi_trigger: str) -> list[str]:
    """Registers memory.events and PSI watches; returns the paths that are active."""
    assert isinstance(guard.cgroup, V2MemoryCgroup)
    paths = []
    guard.fds[guard.cgroup.open_events_watch()] = KERNFS
    paths.append("memory.events")
    if guard.high_set:
        paths.insert(0, f"memory.high at {guard.spec.threshold:.0%}")
    if guard.spec.psi:
        try:
            guard.fds[guard.cgroup.open_psi_trigger(psi_trigger)] = PSI
            paths.append(f"PSI '{psi_trigger}'")
        except (OSError, ValueError):
            pass
    guard.detection = " + ".join(paths)
    return paths


def arm_system(guard: SystemGuard, psi_trigger: str, proc_root: str = "/proc") -> None:
    paths = ["MemAvailable (adaptive polling)"]
    if guard.spec.psi:
        try:
            fd = open_trigger(Path(proc_root, "pressure", "memory"), psi_trigger)
            guard.fds[fd] = PSI
            paths.append(f"PSI '{psi_trigger}' on /proc/pressure/memory")
        except (OSError, ValueError):
            pass
    guard.detection = " + ".join(paths)


def consume(fd: int, kind: str) -> None:
    """Reset an fd after it woke us, so it does not report ready again for the same event."""
    with contextlib.suppress(BlockingIOError, OSError):
        if kind == EVENTFD:
            os.read(fd, 8)
        elif kind == KERNFS:
            rearm_watch(fd)


def high_to_set(guard: CgroupGuard, limit: int, current: int | None) -> bool:
    """Whether arming sets memory.high at the threshold: a memory.high the user set at or
    below it already throttles there (and wakes us), and is left alone."""
    return guard.spec.memory_high and not (
        current is not None and current <= int(limit * guard.spec.threshold))


def set_high_at_threshold(guard: CgroupGuard, cgroup: V2MemoryCgroup, limit: int,
                          change: bool, original: int | None) -> None:
    """memory.high at the threshold: the kernel throttles there and counts a `high` event,
    which wakes us exactly at the crossing (v2 has no usage thresholds). `original` was
    saved (SavedLimits) before this is called."""
    if not guard.spec.memory_high:
        return
    guard.high_set = True
    if not change:
        return
    cgroup.set_high(int(limit * guard.spec.threshold))
    guard.high_original = original
    guard.high_changed = True


def put_back_high(guard: CgroupGuard) -> list[str]:
    """memory.high as it was; returns the SavedLimits key to forget (the caller forgets many
    in one write)."""
    keys = []
    if guard.high_changed and isinstance(guard.cgroup, V2MemoryCgroup):
        with contextlib.suppress(OSError, CgroupGone):
            guard.cgroup.set_high(guard.high_original)
        keys.append(guard.name)
    guard.high_set = False
    guard.high_changed = False
    return keys


OOM_KILL_KEY = "#oom_kill_disable"  # SavedLimits key suffix: the cgroup's path + this


def disable_oom_kill(guard: CgroupGuard, cgroup: V1MemoryCgroup, original: int | None) -> None:
    """v1 `oom_kill_disable` (the default): a task that reaches the limit before oomguard has
    stopped it (memory taken inside one system call, which no SIGSTOP interrupts) waits instead
    of being killed; its OOM event wakes the daemon, which stops it, lifts the limit a little
    and dumps it. Put back when the guard stops (and after a crash, at start). `original` was
    saved (SavedLimits, key name + OOM_KILL_KEY) before this is called."""
    if not guard.spec.oom_kill_disable:
        return
    cgroup.set_oom_kill_disable(True)
    guard.oom_disable_original = bool(original)
    guard.oom_disable_changed = True


def put_back_oom_kill(guard: CgroupGuard) -> list[str]:
    """oom_kill_disable as it was; returns the SavedLimits key to forget."""
    keys = []
    if guard.oom_disable_changed and isinstance(guard.cgroup, V1MemoryCgroup):
        with contextlib.suppress(OSError, CgroupGone):
            guard.cgroup.set_oom_kill_disable(guard.oom_disable_original)
        keys.append(guard.name + OOM_KILL_KEY)
    guard.oom_disable_changed = False
    return keys


def claimed_keys(guards: list[CgroupGuard]) -> set[str]:
    """The SavedLimits keys that armed guards hold (their originals stay saved)."""
    keys = set()
    for guard in guards:
        if guard.high_changed:
            keys.add(guard.name)
        if guard.oom_disable_changed:
            keys.add(guard.name + OOM_KILL_KEY)
    return keys


def put_back_leftovers(saved: SavedLimits, claimed: set[str],
                       open_path: Callable[[str], MemoryCgroup]) -> list[tuple[str, str]]:
    """After a crash: put back every saved original that no armed guard holds (the daemon died
    before it could, and its config no longer guards that cgroup, or no longer that way).
    Returns (cgroup, what was put back); a cgroup that is gone is only forgotten."""
    done = []
    forgotten = []
    for key, original in saved.items().items():
        if key in claimed:
            continue
        path = key.removesuffix(OOM_KILL_KEY)
        with contextlib.suppress(OSError, CgroupGone, ValueError):
            cgroup = open_path(path)
            if key.endswith(OOM_KILL_KEY) and isinstance(cgroup, V1MemoryCgroup):
                cgroup.set_oom_kill_disable(bool(original))
                done.append((path, f"oom_kill_disable {int(bool(original))}"))
            elif not key.endswith(OOM_KILL_KEY) and isinstance(cgroup, V2MemoryCgroup):
                cgroup.set_high(original)
                done.append((path, f"memory.high {'max' if original is None else original}"))
        forgotten.append(key)
    saved.forget_many(forgotten)
    return done
