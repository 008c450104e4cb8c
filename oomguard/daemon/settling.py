"""Work that waits, done after a turn and retried every SETTLE_INTERVAL while any is left:
limits lifted for a dump's headroom to put back, a dead run's leftovers, auto-restores that
wait for room, the store's pruning after a dump."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.cgroup.base import MemoryCgroup
from oomguard.config.loading import DaemonConfig
from oomguard.daemon.autorestore import AutoRestorer
from oomguard.daemon.autoresume import AutoResumer
from oomguard.daemon.guards import CgroupGuard
from oomguard.daemon.storeupkeep import StoreUpkeep
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.policy.pressure import Verdict, evaluate
from oomguard.respond.actor import Actor
from oomguard.sense.procfs import ProcReader

SETTLE_INTERVAL = 2.0  # work that waits (a limit to put back, an auto-restore) is retried this often


class SettlingMixin:
    """Part of Daemon (oomguard/daemon/loop.py): the attributes below are Daemon's."""

    log: Any
    config: DaemonConfig
    checkpointer: Checkpointer
    upkeep: StoreUpkeep
    auto_restore: AutoRestorer
    auto_resume: AutoResumer
    actor: Actor
    proc: ProcReader
    clock: Callable[[], float]
    _starting: bool
    _limit_busy: set[str]  # cgroups whose lifted limit could not be put back yet
    _next_settle: float | None  # None: nothing waits to be settled

    if TYPE_CHECKING:  # Daemon's (never defined here: they would shadow the real ones)
        def _cgroup_guards(self) -> list[CgroupGuard]: ...

        def _cgroup_at(self, path: str) -> MemoryCgroup | None: ...

        def _guard_at(self, path: Path) -> CgroupGuard | None: ...

        def _examine_cgroup(self, guard: CgroupGuard, woke: float, source: str,
                            limit_busy: str = "") -> None: ...

    def _settle(self) -> None:
        """Limits to put back, a dead run's leftovers, auto-restores that wait for room: done
        now, and retried every SETTLE_INTERVAL while any is left."""
        waiting = False
        if self.checkpointer.lifts.pending() or self._limit_busy:
            self._settle_lifts()
            waiting = waiting or self.checkpointer.lifts.pending() or bool(self._limit_busy)
        waiting = self.upkeep.tick() or waiting
        waiting = self.auto_resume.tick(self._guard_of_rel) or waiting
        restoring = [g for g in self._cgroup_guards() if g.spec.auto_restore and g.present] \
            if any(rule.auto_restore for rule in self.config.guards) else []
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
        self._next_settle = self.clock() + SETTLE_INTERVAL if waiting else None

    def _guard_of_rel(self, rel_path: str) -> CgroupGuard | None:
        """The guard of a cgroup by its path in the hierarchy (as records keep it)."""
        for guard in self._cgroup_guards():
            if guard.present and guard.cgroup.rel_path == rel_path:
                return guard
        return None

    def _drop_changed_lifts(self) -> None:
        """At the start, before the guards take their own limits from the ledger: an entry a
        dead run left whose limit someone else (an administrator) set since is theirs now."""
        for settled in self.checkpointer.lifts.drop_changed(self._cgroup_at):
            self.log.warning("limit.left_as_set", cgroup=settled.path,
                             explanation=settled.detail)

    def _settle_lifts(self) -> None:
        """Put back the limits lifted for dumps that no live oomguard needs lifted any more. One
        that cannot be put back (something grew into the lifted room) is retried, and its guard
        acts on the grower at once: the limit comes back, never stays."""
        for path in sorted(self._limit_busy):
            if not self.checkpointer.lifts.lifted(Path(path)):  # put back by a later dump
                self._limit_busy.discard(path)
                self.log.info("limit.restored", cgroup=path,
                              explanation="the limit lifted for a dump's headroom is back")
        for settled in self.checkpointer.lifts.settle(self._cgroup_at):
            if settled.outcome == "restored":
                self.log.info("limit.restored", cgroup=settled.path,
                              explanation="the limit lifted for a dump's headroom is back")
                self._limit_busy.discard(settled.path)
            elif settled.outcome == "changed":  # an administrator's: theirs, not put back
                self._limit_busy.discard(settled.path)
                self.log.warning("limit.left_as_set", cgroup=settled.path,
                                 explanation=settled.detail)
            elif settled.outcome == "busy":
                if settled.path not in self._limit_busy:
                    self._limit_busy.add(settled.path)
                    self.log.error("limit.restore_failed", cgroup=settled.path,
                                   error=settled.detail, explanation="the cgroup grew into the "
                                   "room lifted for a dump; acting on it until the limit is back")
                guard = self._guard_at(Path(settled.path))
                if guard is not None:
                    # Whatever grew there, refused checkpoints too: down to the kill if it must.
                    self._examine_cgroup(guard, self.clock(), "limit-restore",
                                         limit_busy=settled.detail)

    def _leftover_waits(self, pid: int) -> bool:
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
        held = [g for g in self._cgroup_guards() if g.present
                and (rel == g.cgroup.rel_path or rel.startswith(g.cgroup.rel_path.rstrip("/") + "/"))]
        if not held:
            return False
        guard = max(held, key=lambda g: len(g.cgroup.rel_path))
        if self.actor.busy(guard.name):
            return True
        if not self._starting:
            return False
        try:
            snap = self.checkpointer.own_snapshot(guard.cgroup)
        except (CgroupGone, OSError):
            return False
        return evaluate(snap, guard.spec.threshold).verdict is Verdict.ACT

    def _after_dump(self, image_bytes: int, dump_seconds: float) -> None:
        self.upkeep.note_dump(image_bytes, dump_seconds)
        self.upkeep.prune()
