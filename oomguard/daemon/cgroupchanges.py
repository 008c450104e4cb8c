"""What the kernel says changed about the cgroups guarded (inotify: limits written, settings
taken back, cgroups created or removed, entries where rules look for cgroups), and the slow
safety rescan for what notifications could have missed. A guard whose limit or memory.high
changed is armed again; a cgroup that went is let go; one that appeared gets its guard.

Nothing here re-reads a cgroup on a timer: an idle guard costs nothing between events."""

from __future__ import annotations

from oomguard.daemon.cgroupguards import CgroupGuards
from oomguard.daemon.guardarming import GuardArming
from oomguard.daemon.guards import CgroupGuard
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.model.errors import CgroupGone
from oomguard.sense.cgroupfiles import CgroupFiles, Changes, stamp

# With inotify at work, each safety rescan stats a slice of the guards' limit files: a tenth
# of them, and never more than SWEEP_MOST (beyond 160 guards each is looked at every
# guards/16 rescans: an idle daemon guarding 1000 cgroups costs what guarding one does).
SWEEP_SLICES = 10
SWEEP_MOST = 16


def sweep_slice(guards: list[CgroupGuard], turn: int) -> tuple[list[CgroupGuard], int]:
    """The guards one safety rescan looks at (inotify at work), and the next turn."""
    slices = max(SWEEP_SLICES, -(-len(guards) // SWEEP_MOST))
    turn = (turn + 1) % slices
    return guards[turn::slices], turn


class CgroupChanges:
    """Follows the changes the kernel reports for the Daemon's cgroup guards (`guards`), armed
    again by `arming`. Owns the safety rescan's turn (which slice of the guards it looks at
    next)."""

    def __init__(self, *, guards: CgroupGuards, arming: GuardArming, files: CgroupFiles,
                 checkpointer: Checkpointer) -> None:
        self.guards = guards
        self.arming = arming
        self.files = files
        self.checkpointer = checkpointer
        self.sweep_turn = 0  # which slice of the guards the next safety rescan looks at

    def apply_changes(self, changes: Changes) -> None:
        """inotify: limits written, cgroups gone, entries where rules look for cgroups."""
        if changes.overflow:
            self.safety_rescan(everything=True)
            return
        by_name: dict[str, list[CgroupGuard]] = {}
        for guard in self.guards.listed():
            by_name.setdefault(guard.name, []).append(guard)
        beside = [g for g in self.guards.listed()
                  if str(g.cgroup.path.parent) in changes.directories]
        for guard in [*(g for n in changes.gone for g in by_name.get(n, [])), *beside]:
            if guard.present and not guard.cgroup.exists():
                self.guards.cgroup_gone(guard)
        rearm = [g for name in changes.limits for g in by_name.get(name, [])
                 if self._limit_changed(g)]
        rearm += [g for name in changes.settings for g in by_name.get(name, [])
                  if g.present and g not in rearm and self.arming.high_taken(g)]
        if changes.directories:
            if self.guards.globs:
                rearm += self.guards.glob_matches()
            rearm += [g for g in self.guards.listed() if not g.present and not g.pattern
                      and g.cgroup.exists() and g not in rearm]
        self.arming.arm(rearm)
        if changes.directories or changes.gone:
            self.guards.watch_directories()

    def safety_rescan(self, everything: bool = False) -> None:
        """Every rescan_interval (and, for `everything`, when inotify lost events): what
        notifications could have missed. Each guard looked at costs one stat(2) of its limit
        file unless it changed; with inotify at work a slice of the guards is looked at each
        time (see SWEEP_SLICES), without it all of them."""
        rearm = self.guards.glob_matches() if self.guards.globs else []
        guards = self.guards.listed()
        if self.files.available and not everything:
            guards, self.sweep_turn = sweep_slice(guards, self.sweep_turn)
        new = {id(guard) for guard in rearm}
        for guard in guards:
            if id(guard) in new:
                continue
            now = stamp(f"{guard.name}/{guard.cgroup.limit_file}")  # (no Path made: 8 us each)
            if now is None:
                if guard.present and not guard.cgroup.exists():
                    self.guards.cgroup_gone(guard)
                continue
            if not guard.present or now != guard.limit_stamp:
                if self._limit_changed(guard):
                    rearm.append(guard)
                elif guard.present and self.files.available:
                    self.files.watch_limit(guard.name,
                                           guard.cgroup.path / guard.cgroup.limit_file)
            elif not self.files.available and self.arming.high_taken(guard):
                rearm.append(guard)
        self.arming.arm(rearm)
        if self.guards.globs or self.guards.dirs_stale:  # glob directories may have come or gone
            self.guards.watch_directories()

    def _limit_changed(self, guard: CgroupGuard) -> bool:
        """Whether `guard` must be armed again: it came back, or its own limit changed (a
        limit oomguard lifted for a dump's headroom is never taken for the cgroup's own)."""
        guard.limit_stamp = stamp(guard.cgroup.path / guard.cgroup.limit_file)
        if not guard.present:
            return guard.cgroup.exists()
        try:
            snap = guard.cgroup.snapshot()
        except CgroupGone:
            self.guards.cgroup_gone(guard)
            return False
        guard.last_snapshot = snap
        lifted = self.checkpointer.limit_lifted(guard.cgroup.path)
        return snap.limit_bytes != guard.armed_limit and not lifted
