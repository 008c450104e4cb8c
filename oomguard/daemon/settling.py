"""Work that waits, done after a turn and retried every SETTLE_INTERVAL while any is left:
limits lifted for a dump's headroom to put back, a dead run's leftovers, auto-restores that
wait for room, the store's pruning after a dump."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.act.lifts import LimitLifts
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.config.loading import DaemonConfig
from oomguard.daemon.autorestore import AutoRestorer
from oomguard.daemon.autoresume import AutoResumer
from oomguard.daemon.guards import CgroupGuard
from oomguard.daemon.storeupkeep import StoreUpkeep
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.policy.pressure import Verdict, evaluate
from oomguard.respond.actor import Actor
from oomguard.sense.procfs import ProcReader

SETTLE_INTERVAL = 2.0  # work that waits (a limit to put back, an auto-restore) is retried this often


class Settler:
    """Owns what waits to be settled: the cgroups whose lifted limit could not be put back yet
    (`limit_busy`) and when to look again (`next_at`: None, nothing waits). What it needs of
    the daemon comes in as callables: its cgroup guards as they are now, a cgroup or a guard
    by path, the examination that acts on a guard's cgroup, the config in force, and whether
    the daemon is starting."""

    def __init__(self, *, lifts: LimitLifts, own_snapshot: Callable[[MemoryCgroup], MemorySnapshot],
                 upkeep: StoreUpkeep, auto_restore: AutoRestorer, auto_resume: AutoResumer,
                 actor: Actor, proc: ProcReader, log: Any, clock: Callable[[], float],
                 guards: Callable[[], list[CgroupGuard]],
                 cgroup_at: Callable[[str], MemoryCgroup | None],
                 guard_at: Callable[[Path], CgroupGuard | None],
                 examine: Callable[..., None], config: Callable[[], DaemonConfig],
                 starting: Callable[[], bool]) -> None:
        self.lifts = lifts
        self.own_snapshot = own_snapshot
        self.upkeep = upkeep
        self.auto_restore = auto_restore
        self.auto_resume = auto_resume
        self.actor = actor
        self.proc = proc
        self.log = log
        self.clock = clock
        self._guards = guards
        self._cgroup_at = cgroup_at
        self._guard_at = guard_at
        self._examine = examine  # (guard, woke, source, limit_busy=...)
        self._config = config
        self._starting = starting
        self.limit_busy: set[str] = set()  # cgroups whose lifted limit could not be put back yet
        self.next_at: float | None = None  # None: nothing waits to be settled

    def settle(self) -> None:
        """Limits to put back, a dead run's leftovers, auto-restores that wait for room: done
        now, and retried every SETTLE_INTERVAL while any is left."""
        waiting = False
        if self.lifts.pending() or self.limit_busy:
            self.settle_lifts()
            waiting = waiting or self.lifts.pending() or bool(self.limit_busy)
        waiting = self.upkeep.tick() or waiting
        waiting = self.auto_resume.tick(self.guard_of_rel) or waiting
        restoring = [g for g in self._guards() if g.spec.auto_restore and g.present] \
            if any(rule.auto_restore for rule in self._config().guards) else []
        if restoring:
            wanted = self.upkeep.waiting_cgroups()
            for guard in restoring:
                if guard.cgroup.rel_path not in wanted:
                    guard.quiet_since = None
                    continue
                waiting = True
                snap = guard.last_snapshot
                with contextlib.suppress(OSError):
                    snap = guard.cgroup.snapshot()
                    guard.last_snapshot = snap
                if snap is not None:
                    self.auto_restore.consider(guard, snap)
        self.next_at = self.clock() + SETTLE_INTERVAL if waiting else None

    def guard_of_rel(self, rel_path: str) -> CgroupGuard | None:
        """The guard of a cgroup by its path in the hierarchy (as records keep it)."""
        for guard in self._guards():
            if guard.present and guard.cgroup.rel_path == rel_path:
                return guard
        return None

    def drop_changed_lifts(self) -> None:
        """At the start, before the guards take their own limits from the ledger: an entry a
        dead run left whose limit someone else (an administrator) set since is theirs now."""
        for settled in self.lifts.drop_changed(self._cgroup_at):
            self.log.warning("limit.left_as_set", cgroup=settled.path,
                             explanation=settled.detail)

    def settle_lifts(self) -> None:
        """Put back the limits lifted for dumps that no live oomguard needs lifted any more. One
        that cannot be put back (something grew into the lifted room) is retried, and its guard
        acts on the grower at once: the limit comes back, never stays."""
        for path in sorted(self.limit_busy):
            if not self.lifts.lifted(Path(path)):  # put back by a later dump
                self.limit_busy.discard(path)
                self.log.info("limit.restored", cgroup=path,
                              explanation="the limit lifted for a dump's headroom is back")
        for settled in self.lifts.settle(self._cgroup_at):
            if settled.outcome == "restored":
                self.log.info("limit.restored", cgroup=settled.path,
                              explanation="the limit lifted for a dump's headroom is back")
                self.limit_busy.discard(settled.path)
            elif settled.outcome == "changed":  # an administrator's: theirs, not put back
                self.limit_busy.discard(settled.path)
                self.log.warning("limit.left_as_set", cgroup=settled.path,
                                 explanation=settled.detail)
            elif settled.outcome == "busy":
                if settled.path not in self.limit_busy:
                    self.limit_busy.add(settled.path)
                    self.log.error("limit.restore_failed", cgroup=settled.path,
                                   error=settled.detail, explanation="the cgroup grew into the "
                                   "room lifted for a dump; acting on it until the limit is back")
                guard = self._guard_at(Path(settled.path))
                if guard is not None:
                    # Whatever grew there, refused checkpoints too: down to the kill if it must.
                    self._examine(guard, self.clock(), "limit-restore",
                                         limit_busy=settled.detail)

    def leftover_waits(self, pid: int) -> bool:
        """Whether a task a dead run (or its standby) left stopped stays stopped for now: while
        an action on its cgroup runs (it is a bystander of that dump), and at the start while
        its cgroup is over its threshold (the first look acts on it at once). Continued all at
        once before that, the jobs of such a cgroup, catching up on the time they had been
        stopped, reached its limit before the new daemon had stopped a victim (a write(2)
        there failed with ENOMEM)."""
        try:
            rel = self.proc.memory_cgroup(pid) or ""
        except ProcessGone:
            return False
        held = [g for g in self._guards() if g.present
                and (rel == g.cgroup.rel_path or rel.startswith(g.cgroup.rel_path.rstrip("/") + "/"))]
        if not held:
            return False
        guard = max(held, key=lambda g: len(g.cgroup.rel_path))
        if self.actor.busy(guard.name):
            return True
        if not self._starting():
            return False
        try:
            snap = self.own_snapshot(guard.cgroup)
        except (CgroupGone, OSError):
            return False
        return evaluate(snap, guard.spec.threshold).verdict is Verdict.ACT
