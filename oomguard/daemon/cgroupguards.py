"""The daemon's cgroup guards over their life: built from the rules, armed many at once,
followed as the kernel reports changes (a limit written, a cgroup created or removed: inotify),
looked over by a slow safety rescan, and released with everything oomguard changed put back.

Nothing here re-reads a cgroup on a timer: an idle guard costs nothing between events."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.cgroup import watch
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.config.loading import DaemonConfig, GuardConfig
from oomguard.daemon.arming import Armer, LaterMarks, Prepared
from oomguard.daemon.guardlines import guard_line
from oomguard.daemon.guards import (
    CgroupGuard,
    Guard,
    claimed_keys,
    put_back_leftovers,
)
from oomguard.daemon.parkwatch import ParkWatchdog
from oomguard.daemon.standby import Standby
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.model.errors import CgroupGone
from oomguard.respond.actor import rule_parts
from oomguard.sense.cgroupfiles import CgroupFiles, Changes, directories_to_watch, stamp
from oomguard.store.ledger import SavedLimits

# With inotify at work, each safety rescan stats a slice of the guards' limit files: a tenth
# of them, and never more than SWEEP_MOST (beyond 160 guards each is looked at every
# guards/16 rescans: an idle daemon guarding 1000 cgroups costs what guarding one does).
SWEEP_SLICES = 10
SWEEP_MOST = 16
ARM_ROUNDS = 3  # a limit written while arming: armed again, at most this many times in all


def sweep_slice(guards: list[CgroupGuard], turn: int) -> tuple[list[CgroupGuard], int]:
    """The guards one safety rescan looks at (inotify at work), and the next turn."""
    slices = max(SWEEP_SLICES, -(-len(guards) // SWEEP_MOST))
    turn = (turn + 1) % slices
    return guards[turn::slices], turn


class CgroupGuards:
    """The Daemon's cgroup guards (oomguard/daemon/loop.py) as a collaborator. Owns the rules'
    globs, their compiled parts, the safety rescan's turn, whether the directories watched are
    stale, and whether a guard is looked at as soon as it is armed (`examine_on_arm`). Shares
    three values with the Daemon, which hands them in and only ever empties them in place:
    every guard (`guards`, the system rule's too), the owner of each fd the loop polls
    (`fd_owner`) and the timetable of the guards with a time set (`timed`). What it reads of
    the Daemon that can change (the config after a reload, the standby the app sets) it reads
    through callables."""

    def __init__(self, *, config: Callable[[], DaemonConfig], layout: CgroupLayout, log: Any,
                 epoll: Any, checkpointer: Checkpointer, saved_high: SavedLimits, armer: Armer,
                 later_marks: LaterMarks, files: CgroupFiles,
                 park_watch: Callable[[], ParkWatchdog],
                 standby: Callable[[], Standby | None], clock: Callable[[], float],
                 examine_cgroup: Callable[[CgroupGuard, float, str], None],
                 guards: list[Guard], fd_owner: dict[int, tuple[Guard, str]],
                 timed: dict[int, CgroupGuard]) -> None:
        self._config = config
        self.layout = layout
        self.log = log
        self.epoll = epoll
        self.checkpointer = checkpointer
        self.saved_high = saved_high
        self.armer = armer
        self.later_marks = later_marks
        self.files = files
        self._park_watch = park_watch
        self._standby = standby
        self.clock = clock
        self._examine_cgroup = examine_cgroup
        self.guards = guards
        self.fd_owner = fd_owner
        self.timed = timed  # id -> the guard, for those with a due_at
        self.globs: list[tuple[GuardConfig, str]] = []
        self.rule_parts: dict[int, Any] = {}  # id(rule) -> its compiled parts (RuleParts)
        self.sweep_turn = 0  # which slice of the guards the next safety rescan looks at
        self.dirs_stale = False  # a guard went: the directories watched must be worked out again
        self.examine_on_arm = True  # False while the daemon's arm() builds the guards at start

    @property
    def config(self) -> DaemonConfig:
        return self._config()

    @property
    def park_watch(self) -> ParkWatchdog:
        return self._park_watch()

    @property
    def standby(self) -> Standby | None:
        return self._standby()

    def forget_rules(self) -> None:
        """A reload: the rules' globs and parts go with the old rules (the guards, the fds and
        the timetable are emptied by the Daemon, which shares them)."""
        self.globs = []
        self.rule_parts = {}

    # -- building and arming ---------------------------------------------------------------------

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

    def arm(self, guards: list[CgroupGuard]) -> None:
        """Arm these guards together (concurrently: see arming.py), then register and report
        each, and look at each that is over its threshold already; their marks beyond the
        threshold follow from beside the loop (add_later_marks)."""
        if not guards:  # a rescan that found nothing: the directories watched stand
            return
        armed: list[Prepared] = []
        for round_ in range(ARM_ROUNDS):
            if not guards:
                break
            for guard in guards:
                self._disarm(guard)
            last = round_ == ARM_ROUNDS - 1
            again = []
            for prepared in self.armer.arm(guards):
                if self._finish_arming(prepared, recheck=not last):
                    again.append(prepared.guard)
                elif prepared.guard.fds:
                    armed.append(prepared)
            guards = again
        self.later_marks.start(armed)
        self.watch_directories()  # where the missing would appear, beside the present

    def add_later_marks(self) -> None:
        """The marks beyond the threshold that came in from beside the loop: added to each
        guard still armed as it was when they were asked for, closed for the others (armed
        again, gone, released)."""
        added = 0
        for marks in self.later_marks.take():
            guard = marks.guard
            if guard.generation != marks.generation or not guard.present:
                for fd in marks.fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                continue
            if marks.error is not None:
                self.log.warning("guard.marks_incomplete", cgroup=guard.name,
                                 error=marks.error, explanation="the threshold mark "
                                 "is armed; page cache above it is polled")
            for fd in marks.fds:
                guard.fds[fd] = watch.EVENTFD
                self.epoll.register(fd, watch.EPOLL_MASK[watch.EVENTFD])
                self.fd_owner[fd] = (guard, watch.EVENTFD)
            added += bool(marks.fds)
        if added:
            self.log.info("guard.marks_added", guards=added,
                          explanation="the marks beyond the threshold, which wake the daemon "
                          "as resident memory catches up with page cache")

    def _finish_arming(self, prepared: Prepared, recheck: bool = True) -> bool:
        """Register and report one armed guard. True (nothing registered: arm it again) when
        `recheck` and its limit was written while it was being armed, after the read and
        before the inotify watch (a job scheduler sets the limit of a cgroup it has just
        made): no event would tell, and the file's stamp already has the write in it."""
        guard, snap = prepared.guard, prepared.snapshot
        if snap is None:
            if guard.present:
                self.log.warning("guard.cgroup_missing", cgroup=guard.name)
            guard.present = False
            guard.limit_stamp = None
            return False
        guard.present = True
        guard.armed_limit = snap.limit_bytes
        guard.oom_kills = snap.oom_kills
        guard.last_snapshot = snap
        guard.limit_stamp = stamp(guard.cgroup.path / guard.cgroup.limit_file)
        self.files.watch_limit(guard.name, guard.cgroup.path / guard.cgroup.limit_file)
        setting = watch.replaced_setting_file(guard)
        if setting is None:
            self.files.unwatch_setting(guard.name)
        else:
            self.files.watch_setting(guard.name, setting)
        if recheck and (self._limit_moved(guard, snap.limit_bytes) or self.high_taken(guard)):
            return True
        if snap.limit_bytes is None:
            guard.detection = "none (no memory limit)"
        else:
            if prepared.error is not None:
                self.log.warning("guard.events_unavailable", cgroup=guard.name,
                                 error=prepared.error)
                self._disarm(guard)
            if not guard.fds:
                guard.detection = ""
            # v2 reports no usage crossings by itself: without memory.high it is polled.
            guard.poll_only = not guard.fds or not watch.reports_crossings(guard)
            if guard.poll_only:
                polled = f"polling every {self.config.poll_interval * 1000:.0f}ms"
                guard.detection = f"{guard.detection} + {polled}" if guard.fds else polled
                self.set_due(guard, self.clock())
            self.register(guard)
            parking = watch.parks_at_limit(guard)
            if parking is not None:
                self.park_watch.watch(guard.name, parking, guard.spec.park_deadline)
                if self.standby is not None:  # stops it at the threshold while no daemon runs
                    self.standby.tell(guard.name, int(snap.limit_bytes * guard.spec.threshold),
                                      str(parking.mount), guard.spec.park_deadline)
        self.log.info("guard.armed", cgroup=guard.name, cgroup_version=guard.cgroup.version,
                      detection=guard.detection, limit=snap.limit_bytes,
                      threshold=guard.spec.threshold, usage=snap.usage_bytes,
                      summary=guard_line(guard, snap.limit_bytes, dry_run=self.config.dry_run))
        # Already over the threshold when armed: no crossing will come, look now.
        if self.examine_on_arm and snap.limit_bytes is not None:
            self._examine_cgroup(guard, self.clock(), "arm")
        return False

    def _limit_moved(self, guard: CgroupGuard, armed: int | None) -> bool:
        """Whether the guard's limit file now says other than `armed` (one read; a limit
        oomguard lifted for a dump's headroom does not count)."""
        if self.checkpointer.limit_lifted(guard.cgroup.path):
            return False
        try:
            return guard.cgroup.limit() != armed
        except (CgroupGone, OSError):
            return False  # gone: the directory watch and the rescan say so

    def set_due(self, guard: CgroupGuard, at: float | None) -> None:
        """When to look at `guard` without an event (None: only on events), in the
        timetable the loop's GuardPolls reads."""
        guard.due_at = at
        if at is None:
            self.timed.pop(id(guard), None)
        else:
            self.timed[id(guard)] = guard

    def register(self, guard: Guard) -> None:
        for fd, kind in guard.fds.items():
            self.epoll.register(fd, watch.EPOLL_MASK[kind])
            self.fd_owner[fd] = (guard, kind)

    def _disarm(self, guard: Guard) -> None:
        if isinstance(guard, CgroupGuard):
            guard.generation += 1  # marks still coming in for it are stale
        for fd in guard.fds:
            with contextlib.suppress(OSError):
                self.epoll.unregister(fd)
            self.fd_owner.pop(fd, None)
            with contextlib.suppress(OSError):
                os.close(fd)
        guard.fds.clear()

    # -- what the kernel says changed ------------------------------------------------------------

    def listed(self) -> list[CgroupGuard]:
        """The cgroup guards among every guard (not the system rule's)."""
        return [g for g in self.guards if isinstance(g, CgroupGuard)]

    def apply_changes(self, changes: Changes) -> None:
        """inotify: limits written, cgroups gone, entries where rules look for cgroups."""
        if changes.overflow:
            self.safety_rescan(everything=True)
            return
        by_name: dict[str, list[CgroupGuard]] = {}
        for guard in self.listed():
            by_name.setdefault(guard.name, []).append(guard)
        beside = [g for g in self.listed()
                  if str(g.cgroup.path.parent) in changes.directories]
        for guard in [*(g for n in changes.gone for g in by_name.get(n, [])), *beside]:
            if guard.present and not guard.cgroup.exists():
                self.cgroup_gone(guard)
        rearm = [g for name in changes.limits for g in by_name.get(name, [])
                 if self._limit_changed(g)]
        rearm += [g for name in changes.settings for g in by_name.get(name, [])
                  if g.present and g not in rearm and self.high_taken(g)]
        if changes.directories:
            if self.globs:
                rearm += self.glob_matches()
            rearm += [g for g in self.listed() if not g.present and not g.pattern
                      and g.cgroup.exists() and g not in rearm]
        self.arm(rearm)
        if changes.directories or changes.gone:
            self.watch_directories()

    def _limit_changed(self, guard: CgroupGuard) -> bool:
        """Whether `guard` must be armed again: it came back, or its own limit changed (a
        limit oomguard lifted for a dump's headroom is never taken for the cgroup's own)."""
        guard.limit_stamp = stamp(guard.cgroup.path / guard.cgroup.limit_file)
        if not guard.present:
            return guard.cgroup.exists()
        try:
            snap = guard.cgroup.snapshot()
        except CgroupGone:
            self.cgroup_gone(guard)
            return False
        guard.last_snapshot = snap
        lifted = self.checkpointer.limit_lifted(guard.cgroup.path)
        return snap.limit_bytes != guard.armed_limit and not lifted

    def high_taken(self, guard: CgroupGuard) -> bool:
        """Whether another writer raised the memory.high oomguard set at the guard's threshold
        (then the kernel would throttle and wake oomguard only at the limit): said, and its
        value made the one to put back, for arming to set it at the threshold again. Not while
        oomguard itself has lifted it for a dump."""
        if guard.armed_limit is None or self.checkpointer.limit_lifted(guard.cgroup.path):
            return False
        found = watch.high_taken_back(guard, guard.armed_limit)
        if found is None:
            return False
        self.log.warning("guard.high_taken_back", cgroup=guard.name, memory_high=found,
                         threshold_bytes=int(guard.armed_limit * guard.spec.threshold),
                         explanation="another writer (a job scheduler, systemd's MemoryHigh=) "
                         "set memory.high above the guard's threshold, where the kernel would "
                         "wake oomguard only at the limit: set at the threshold again; theirs "
                         "is what oomguard puts back when it lets go")
        self.saved_high.forget(watch.saved_key(guard))
        return True

    def safety_rescan(self, everything: bool = False) -> None:
        """Every rescan_interval (and, for `everything`, when inotify lost events): what
        notifications could have missed. Each guard looked at costs one stat(2) of its limit
        file unless it changed; with inotify at work a slice of the guards is looked at each
        time (see SWEEP_SLICES), without it all of them."""
        rearm = self.glob_matches() if self.globs else []
        guards = self.listed()
        if self.files.available and not everything:
            guards, self.sweep_turn = sweep_slice(guards, self.sweep_turn)
        new = {id(guard) for guard in rearm}
        for guard in guards:
            if id(guard) in new:
                continue
            now = stamp(f"{guard.name}/{guard.cgroup.limit_file}")  # (no Path made: 8 us each)
            if now is None:
                if guard.present and not guard.cgroup.exists():
                    self.cgroup_gone(guard)
                continue
            if not guard.present or now != guard.limit_stamp:
                if self._limit_changed(guard):
                    rearm.append(guard)
                elif guard.present and self.files.available:
                    self.files.watch_limit(guard.name,
                                           guard.cgroup.path / guard.cgroup.limit_file)
            elif not self.files.available and self.high_taken(guard):
                rearm.append(guard)
        self.arm(rearm)
        if self.globs or self.dirs_stale:  # glob directories may have come or gone
            self.watch_directories()

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
            self._disarm(guard)
            self.files.unwatch(guard.name)
            self.saved_high.forget_many(self._put_back(guard))  # the cgroup is gone: forgets
            guard.present = False
            self.set_due(guard, None)
            guard.limit_stamp = None
            self.dirs_stale = True  # watch where it would be made again

    def _put_back(self, guard: CgroupGuard) -> list[str]:
        """memory.high and oom_kill_disable as they were; returns the SavedLimits keys."""
        self.park_watch.unwatch(guard.name)  # first: the watchdog must not write after it
        if self.standby is not None:
            self.standby.forget(guard.name)
        return watch.put_back(guard)

    def release(self) -> None:
        self.later_marks.join()
        forgotten: list[str] = []
        for guard in self.guards:
            self._disarm(guard)
            if isinstance(guard, CgroupGuard):
                self.files.unwatch(guard.name)
                forgotten += self._put_back(guard)
        self.saved_high.forget_many(forgotten)
        self.files.watch_directories(set())
        self.add_later_marks()  # every guard let go: what came in is closed

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
