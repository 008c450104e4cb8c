"""What the daemon watches, per rule: one cgroup (its notification fds, armed by
oomguard.cgroup.watch whatever the cgroup version) or the whole system (a PSI trigger on
/proc/pressure/memory and MemAvailable)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.watch import OOM_KILL_KEY, PSI, Replaced, claimed_key, put_back_saved
from oomguard.config.loading import GuardConfig
from oomguard.lifecycle.restorefit import GuardLookup, RestoreGuard, guard_for
from oomguard.model.errors import CgroupGone
from oomguard.policy.guardlook import GuardHistory
from oomguard.sense.cgroupfiles import Stamp
from oomguard.sense.psi import has_cap_sys_resource, open_trigger, shortest_window_us, trigger_string
from oomguard.store.ledger import SavedLimits

PSI_STALL_SHARE = 10  # a trigger fires at 10% of the window stalled ("some")


@dataclass(slots=True)
class CgroupGuard:
    spec: GuardConfig
    cgroup: MemoryCgroup
    fds: dict[int, str] = field(default_factory=dict)
    generation: int = 0  # one more each time its fds are let go (marks made before are stale)
    armed_limit: int | None = None
    poll_only: bool = False
    oom_kills: int = 0
    present: bool = True
    detection: str = ""
    replaced: Replaced = field(default_factory=Replaced)  # to watch it (cgroup.watch's own)
    quiet_since: float | None = None  # auto-restore: since when the checkpoint would fit
    pattern: str = ""  # the glob this cgroup was found by, if any
    parts: Any = None  # the rule's compiled chain, preferences and settings (acting.RuleParts)
    last_snapshot: MemorySnapshot | None = None  # the latest reading (for the gauges)
    limit_stamp: Stamp | None = None  # the limit file when last read (the safety rescan)
    due_at: float | None = None  # look again then without an event (polls, a cache-only watch)
    # What it carries from look to look (cache-only watch, plug-in states, reclaim counted):
    # a new value from each look (policy.guardlook.look_at_cgroup), replaced, never changed.
    history: GuardHistory = field(default_factory=GuardHistory)
    # When another writer took back the memory.high oomguard set (monotonic; the recent ones).
    high_takebacks: tuple[float, ...] = ()

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

    @property
    def name(self) -> str:
        return "system"


Guard = CgroupGuard | SystemGuard


def psi_trigger_for(proc_root: str = "/proc") -> str:
    """The fastest trigger this process may register: a 500 ms window with CAP_SYS_RESOURCE,
    else 2 s (the kernel's rule for unprivileged triggers)."""
    try:
        privileged = has_cap_sys_resource(Path(proc_root, "self", "status").read_text())
    except OSError:
        privileged = False
    window = shortest_window_us(privileged)
    return trigger_string("some", window // PSI_STALL_SHARE, window)


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


def claimed_keys(guards: list[CgroupGuard]) -> set[str]:
    """The SavedLimits keys that armed guards hold (their originals stay saved)."""
    return {key for guard in guards if (key := claimed_key(guard)) is not None}


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
            what = put_back_saved(open_path(path), key, original)
            if what is not None:
                done.append((path, what))
        forgotten.append(key)
    saved.forget_many(forgotten)
    return done


def daemon_lookup(current: Callable[[], Iterable[CgroupGuard | SystemGuard]]) -> GuardLookup:
    """The lookup over the daemon's rules as they are at the time of asking (a reload
    replaces them): cgroup rules only; the first that guards the cgroup wins."""

    def lookup(cgroup: MemoryCgroup) -> RestoreGuard | None:
        rules = [RestoreGuard(g.cgroup.path, g.spec.threshold, g.spec.restore_margin)
                 for g in list(current()) if isinstance(g, CgroupGuard)]
        return guard_for(cgroup, rules)
    return lookup
