"""What the daemon's events feed besides the log: Prometheus metrics and the user's hooks.

The daemon logs one event per thing that happens; `EventTap` sees each one (through
logsetup.RecordingLogger) and turns the ones that matter into metric updates and hook runs, so
no part of the daemon has to know about either.
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
from oomguard.observe.hooks import HookRunner
from oomguard.observe.slurm import SlurmError, SlurmNotifier
from oomguard.sense.owners import SlurmStep
from oomguard.store.checkpoints import CheckpointMeta

if TYPE_CHECKING:  # prometheus_client is imported only where metrics are wanted
    from oomguard.observe.metrics import Metrics


def slurm_owner(fields: dict[str, Any]) -> SlurmStep | None:
    """The Slurm job step a checkpoint.done event's owner fields (meta.json's) name."""
    if fields.get("scheduler") != "slurm":
        return None
    try:
        job_id = int(fields["slurm_job_id"])
    except (KeyError, TypeError, ValueError):
        return None
    step = fields.get("slurm_step")
    uid = fields.get("slurm_uid")
    return SlurmStep(job_id, None if step is None else str(step),
                     uid if isinstance(uid, int) else None)


HOOKED = {"checkpoint.done": "on_checkpoint", "restore.done": "on_restore",
          "victim.killed": "on_kill"}


class EventTap:
    def __init__(self, metrics: Metrics | None = None, hooks: HookRunner | None = None,
                 emitter: SignalEmitter | None = None,
                 slurm: SlurmNotifier | None = None) -> None:
        self.metrics = metrics
        self.hooks = hooks
        self.emitter = emitter
        self.slurm = slurm
        self.log: Any = None  # set once the logger that calls this tap exists

    def _tell_slurm(self, fields: dict[str, Any]) -> None:
        """A Slurm job step was checkpointed: AdminComment and requeue, off the caller's
        thread (the log line of the checkpoint comes first). Whose job it was comes from the
        checkpoint's own owner fields (the cgroup the tree was in), never from the guard's
        name, which is "system" for a system rule and "PATH (GPU)" for a GPU rule."""
        step = slurm_owner(fields)
        if step is None or self.slurm is None:
            return
        notifier, log = self.slurm, self.log

        def tell() -> None:
            try:
                done = notifier.notify(step.job_id, step.step, str(fields.get("id", "")),
                                       time.time(), str(fields.get("reason") or "memory"))
            except SlurmError as exc:
                if log is not None:
                    log.error("slurm.notify_failed", job_id=step.job_id, error=str(exc))
                return
            if log is not None:
                log.warning("slurm.notified", job_id=step.job_id, step=step.step,
                            id=fields.get("id"), done=done)

        threading.Thread(target=tell, name="oomguard-slurm", daemon=True).start()

    def __call__(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if event == "checkpoint.done" and self.slurm is not None:
            self._tell_slurm(fields)
        if self.metrics is not None:
            self._count(event, fields)
        if self.emitter is not None and event in ("checkpoint.done", "restore.done") \
                and "uid" in fields and "id" in fields:
            emit = (self.emitter.emit_checkpointed if event == "checkpoint.done"
                    else self.emitter.emit_restored)
            emit(int(fields["uid"]), str(fields["id"]), str(fields.get("command", "")),
                 int(fields.get("pid") or 0))
        if self.hooks is not None and event in HOOKED:
            self.hooks.fire(HOOKED[event], {k: v for k, v in fields.items()
                                            if isinstance(v, str | int | float | bool)})

    def _count(self, event: str, fields: dict[str, Any]) -> None:
        assert self.metrics is not None
        m = self.metrics
        if event == "checkpoint.done":
            m.checkpoint_done(int(fields.get("image_bytes") or 0),
                              float(fields.get("seconds") or 0.0),
                              max(0, int(fields.get("rss") or 0)))
        elif event == "checkpoint.failed":
            m.checkpoint_failed()
        elif event == "checkpoint.refused":
            m.checkpoint_refused()
        elif event in ("restore.done", "restore.failed"):
            m.restore("done" if event == "restore.done" else "failed", bool(fields.get("auto")))
        elif event == "victim.killed":
            m.kill()
        elif event == "victim.frozen" and "detect_to_frozen_ms" in fields:
            m.detection(max(0.0, float(fields["detect_to_frozen_ms"]) / 1000))


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
