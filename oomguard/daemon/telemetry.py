"""What the daemon's events feed besides the log: Prometheus metrics, the user's hooks, D-Bus
and Slurm; and the gauges the metrics show.

The daemon publishes a typed event (observe/events.py) where a checkpoint, a restore, a kill
or a freeze happens; logsetup.RecordingLogger writes its log line and hands it to `EventTap`,
which hands it on, so no part of the daemon has to know about any consumer and no consumer
reads log fields.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from oomguard.cgroup.watch import pressure_avg10
from oomguard.daemon.guards import CgroupGuard, SystemGuard
from oomguard.model.errors import CgroupGone
from oomguard.observe.dbus import SignalEmitter
from oomguard.observe.events import (
    HOOK_OF,
    CheckpointDone,
    CheckpointFailed,
    CheckpointRefused,
    Event,
    RestoreDone,
    RestoreFailed,
    VictimFrozen,
    VictimKilled,
)
from oomguard.observe.hooks import HookRunner
from oomguard.observe.slurm import SlurmError, SlurmNotifier
from oomguard.sense.owners import SlurmStep
from oomguard.store.checkpoints import CheckpointMeta

if TYPE_CHECKING:  # prometheus_client is imported only where metrics are wanted
    from oomguard.observe.metrics import Metrics


class EventTap:
    """Takes every typed event the daemon publishes (logsetup.RecordingLogger calls `tell`)
    to the metrics, the hooks, D-Bus and Slurm."""

    def __init__(self, metrics: Metrics | None = None, hooks: HookRunner | None = None,
                 emitter: SignalEmitter | None = None,
                 slurm: SlurmNotifier | None = None) -> None:
        self.metrics = metrics
        self.hooks = hooks
        self.emitter = emitter
        self.slurm = slurm
        self.log: Any = None  # set once the logger that calls this tap exists

    def tell(self, happened: Event) -> None:
        if isinstance(happened, CheckpointDone) and happened.slurm is not None:
            self._tell_slurm(happened, happened.slurm)
        if self.metrics is not None:
            self._count(happened)
        if self.emitter is not None and isinstance(happened, CheckpointDone | RestoreDone) \
                and happened.uid is not None and happened.id:
            emit = (self.emitter.emit_checkpointed if isinstance(happened, CheckpointDone)
                    else self.emitter.emit_restored)
            emit(happened.uid, happened.id, happened.command, happened.pid)
        hook = HOOK_OF.get(type(happened))
        if self.hooks is not None and hook is not None:
            assert isinstance(happened, CheckpointDone | RestoreDone | VictimKilled)
            self.hooks.fire(hook, happened.hook)

    def _tell_slurm(self, done: CheckpointDone, step: SlurmStep) -> None:
        """A Slurm job step was checkpointed: AdminComment and requeue, off the caller's
        thread (the log line of the checkpoint comes first)."""
        if self.slurm is None:
            return
        notifier, log = self.slurm, self.log

        def tell() -> None:
            try:
                told = notifier.notify(step.job_id, step.step, done.id, time.time(),
                                       done.reason)
            except SlurmError as exc:
                if log is not None:
                    log.error("slurm.notify_failed", job_id=step.job_id, error=str(exc))
                return
            if log is not None:
                log.warning("slurm.notified", job_id=step.job_id, step=step.step,
                            id=done.id, done=told)

        threading.Thread(target=tell, name="oomguard-slurm", daemon=True).start()

    def _count(self, happened: Event) -> None:
        assert self.metrics is not None
        m = self.metrics
        if isinstance(happened, CheckpointDone):
            m.checkpoint_done(happened.image_bytes, happened.seconds, happened.freed_bytes)
        elif isinstance(happened, CheckpointFailed):
            m.checkpoint_failed()
        elif isinstance(happened, CheckpointRefused):
            m.checkpoint_refused()
        elif isinstance(happened, RestoreDone):
            m.restore("done", happened.auto)
        elif isinstance(happened, RestoreFailed):
            m.restore("failed", happened.auto)
        elif isinstance(happened, VictimKilled):
            m.kill()
        elif isinstance(happened, VictimFrozen):
            m.detection(happened.detect_to_frozen_s)


def publish_gauges(metrics: Metrics, guards: Iterable[CgroupGuard | SystemGuard],
                   checkpoints: list[CheckpointMeta]) -> None:
    """The current picture: guards, cgroups watched with usage/limit/pressure, the store."""
    guards = list(guards)
    cgroup_guards = [g for g in guards if isinstance(g, CgroupGuard)]
    metrics.set_guards(len(guards), sum(1 for g in cgroup_guards if g.present))
    for guard in cgroup_guards:
        if not guard.present:
            metrics.forget_cgroup(guard.name)
            continue
        snap = guard.last_snapshot  # the rescan's, at most a rescan interval old
        if snap is None:
            try:
                snap = guard.cgroup.snapshot()
            except CgroupGone:
                metrics.forget_cgroup(guard.name)
                continue
        metrics.set_cgroup(guard.name, snap.usage_bytes, snap.limit_bytes,
                           pressure_avg10(guard.cgroup))
    metrics.set_store(sum(c.image_bytes for c in checkpoints), len(checkpoints))
