"""The daemon's cgroup guards over their life: built from the rules (a guard for each cgroup
named, and for each a glob matches), found by path, watched for where cgroups would appear,
and let go with everything oomguard changed put back. Arming them is guardarming.py's; what
the kernel says changed about them, and the safety rescan, cgroupchanges.py's; the fds and
the timetable the loop waits on, registrations.py's."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from oomguard.cgroup import watch
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.config.loading import GuardConfig
from oomguard.daemon.guards import (
    CgroupGuard,
    Guard,
    claimed_keys,
    put_back_leftovers,
)
from oomguard.daemon.parkwatch import ParkWatchdog
from oomguard.daemon.registrations import Registrations
from oomguard.daemon.standby import Standby
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.policy.preferences import Preferences
from oomguard.respond.actor import RuleParts, rule_parts
from oomguard.sense.cgroupfiles import CgroupFiles, directories_to_watch
from oomguard.store.ledger import SavedLimits


class CgroupGuards:
    """The Daemon's cgroup guards (oomguard/daemon/loop.py) as a collaborator. Owns the rules'
    globs, their compiled parts and whether the directories watched are stale. Shares one
    value with the Daemon, which hands it in and only ever empties it in place: every guard
    (`guards`, the system rule's too). What it reads of the Daemon that can change (the park
    watchdog, the standby the app sets) it reads through callables."""

    def __init__(self, *, layout: CgroupLayout, log: Any, checkpointer: Checkpointer,
                 saved_high: SavedLimits, registrations: Registrations, files: CgroupFiles,
                 park_watch: Callable[[], ParkWatchdog],
                 standby: Callable[[], Standby | None], guards: list[Guard]) -> None:
        self.layout = layout
        self.log = log
        self.checkpointer = checkpointer
        self.saved_high = saved_high
        self.registrations = registrations
        self.files = files
        self._park_watch = park_watch
        self._standby = standby
        self.guards = guards
        self.globs: list[tuple[GuardConfig, str]] = []
        self.rule_parts: dict[int, Any] = {}  # id(rule) -> its compiled parts (RuleParts)
        self.dirs_stale = False  # a guard went: the directories watched must be worked out again

    @property
    def park_watch(self) -> ParkWatchdog:
        return self._park_watch()

    @property
    def standby(self) -> Standby | None:
        return self._standby()

    def forget_rules(self) -> None:
        """A reload: the rules' globs and parts go with the old rules (the guards are emptied
        by the Daemon, which shares them)."""
        self.globs = []
        self.rule_parts = {}

    # -- building ----------------------------------------------------------------------------------

    def new_guard(self, spec: GuardConfig, path: str, pattern: str = "") -> CgroupGuard:
        guard = CgroupGuard(spec=spec, cgroup=open_cgroup(path, self.layout), pattern=pattern)
        guard.parts = self.rule_parts.get(id(spec))
        if guard.parts is None:  # compiled once per rule, shared by all its cgroups
            guard.parts = self.rule_parts[id(spec)] = rule_parts(spec)
        self.guards.append(guard)
        return guard

    def glob_matches(self) -> list[CgroupGuard]:
        """Rules may name cgroups by glob (`/slurm/uid_*/job_*`): a guard for each that exists
        now and has none; those that went away are dropped."""
        new = []
        known = {g.name for g in self.guards if isinstance(g, CgroupGuard)}
        for spec, pattern in self.globs:
            for match in sorted(glob.glob(self._fs_pattern(pattern))):
                if match not in known and os.path.isdir(match):
                    new.append(self.new_guard(spec, match, pattern))
                    known.add(match)
        for guard in list(self.guards):
            if isinstance(guard, CgroupGuard) and guard.pattern and not guard.cgroup.exists():
                self.cgroup_gone(guard)
                self.guards.remove(guard)
        return new

    def _fs_pattern(self, pattern: str) -> str:
        mount = self.layout.memory_mount
        return pattern if mount is None or pattern.startswith(str(mount)) else \
            str(mount) + "/" + pattern.lstrip("/")

    # -- where they are and would appear ---------------------------------------------------------

    def listed(self) -> list[CgroupGuard]:
        """The cgroup guards among every guard (not the system rule's)."""
        return [g for g in self.guards if isinstance(g, CgroupGuard)]

    def watch_directories(self) -> None:
        """Where cgroups would appear: below each glob's fixed part, and the nearest existing
        ancestor of each configured cgroup that does not exist (yet)."""
        wanted: set[str] = set()
        for _spec, pattern in self.globs:
            wanted.update(directories_to_watch(self._fs_pattern(pattern)))
        self.dirs_stale = False
        for guard in self.listed():
            if guard.pattern:
                continue  # its parent is among its glob's directories
            if guard.present:
                wanted.add(str(guard.cgroup.path.parent))  # to see it removed
            else:
                wanted.update(directories_to_watch(str(guard.cgroup.path)))
        self.files.watch_directories(wanted)

    # -- letting go --------------------------------------------------------------------------------

    def cgroup_gone(self, guard: CgroupGuard) -> None:
        if guard.present:
            self.log.warning("guard.cgroup_gone", cgroup=guard.name)
            self.registrations.disarm(guard)
            self.files.unwatch(guard.name)
            self.saved_high.forget_many(self._put_back(guard))  # the cgroup is gone: forgets
            guard.high_takebacks = ()  # (and a yielded memory.high: a new one is armed anew)
            guard.present = False
            self.registrations.set_due(guard, None)
            guard.limit_stamp = None
            self.dirs_stale = True  # watch where it would be made again

    def _put_back(self, guard: CgroupGuard) -> list[str]:
        """memory.high and oom_kill_disable as they were; returns the SavedLimits keys."""
        self.park_watch.unwatch(guard.name)  # first: the watchdog must not write after it
        if self.standby is not None:
            self.standby.forget(guard.name)
        return watch.put_back(guard)

    def release(self) -> None:
        self.registrations.later_marks.join()
        forgotten: list[str] = []
        for guard in self.guards:
            self.registrations.disarm(guard)
            if isinstance(guard, CgroupGuard):
                self.files.unwatch(guard.name)
                forgotten += self._put_back(guard)
        self.saved_high.forget_many(forgotten)
        self.files.watch_directories(set())
        self.registrations.add_later_marks()  # every guard let go: what came in is closed

    def put_back_leftovers(self) -> None:
        """What a dead run changed on cgroups that no rule now changes the same way."""
        for cgroup, setting in put_back_leftovers(
                self.saved_high, claimed_keys(self.listed()),
                lambda path: open_cgroup(path, self.layout)):
            self.log.info("guard.setting_restored", cgroup=cgroup, setting=setting,
                          explanation="put back after a previous run that did not stop cleanly")
        for pid in self.checkpointer.shield.recover():
            self.log.info("guard.setting_restored", pid=pid, setting="oom_score_adj",
                          explanation="put back after a previous run that did not stop cleanly")

    def note_oom_kills(self, guard: CgroupGuard, snap: MemorySnapshot) -> None:
        if snap.oom_kills > guard.oom_kills:
            self.log.error("oom.kill_seen", cgroup=guard.name,
                           kills=snap.oom_kills - guard.oom_kills,
                           explanation="the kernel OOM killer acted before oomguard could")
        guard.oom_kills = snap.oom_kills

    # -- found by path -----------------------------------------------------------------------------

    def cgroup_at(self, path: str) -> MemoryCgroup | None:
        try:
            return open_cgroup(path, self.layout)
        except ValueError:
            return None

    def guard_at(self, path: Path) -> CgroupGuard | None:
        for guard in self.listed():
            if guard.present and guard.cgroup.path == path:
                return guard
        return None

    def preferences_for(self, cgroup: MemoryCgroup) -> Preferences | None:
        """The victim preferences of the rule guarding `cgroup` (parts are set when a guard
        is made)."""
        guard = self.guard_at(cgroup.path)
        return None if guard is None else cast(RuleParts, guard.parts).prefs

    def user_headroom(self, cgroup: MemoryCgroup) -> int:
        """Headroom for a non-root user's on-demand checkpoint in `cgroup`: only where its
        rule says `user_headroom = true`."""
        guard = self.guard_at(cgroup.path)
        return guard.spec.headroom if guard is not None and guard.spec.user_headroom else 0
