"""The daemon's events that feed more than the log, as types: a checkpoint, a restore, a kill
and a freeze. The daemon makes each where it happens and publishes it to an EventSink; the log
line is written from the event (its `name`, `level` and `log_fields()`), and the same event
goes to the metrics, the hooks, D-Bus and Slurm (observe/telemetry.py's EventTap), none of
which reads log fields.

The log fields are those the daemon has always logged, under the same names; a hook's
environment is their scalar values (README: Hooks)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from oomguard.model.jobcommand import job_command
from oomguard.model.units import format_size
from oomguard.observe.dbus import restore_command
from oomguard.sense.owners import SlurmStep

if TYPE_CHECKING:
    from oomguard.lifecycle.checkpointrun import CheckpointTimings
    from oomguard.lifecycle.restoreoutcome import RestoreResult
    from oomguard.model.checkpointmeta import CheckpointMeta

HookFields = Mapping[str, str | int | float | bool]
# An action's fields (the victim: cgroup, pid, comm, rss, tasks...), which every event of the
# action carries (oomguard/respond/actor.py).
VictimFields = Mapping[str, Any]

OWNER_KEYS = ("scheduler", "slurm_job_id", "slurm_step", "slurm_uid", "pod_uid", "qos",
              "container_id", "container_runtime")
KILLED = "the rule's last action: no checkpoint was possible"
# What Slurm's AdminComment gives as a checkpoint's reason: checkpoint.done has never logged
# the rule's reason (meta.json keeps it).
SLURM_REASON = "memory"


def owner_of_meta(extra: Mapping[str, Any]) -> dict[str, Any]:
    """meta.json's scheduler fields (scheduler.owner_fields), for the event that tells whose
    job was checkpointed."""
    return {key: extra[key] for key in OWNER_KEYS if key in extra}


def slurm_owner(fields: Mapping[str, Any]) -> SlurmStep | None:
    """The Slurm job step a checkpoint's owner fields (meta.json's) name. Whose job it was
    comes from the checkpoint's own owner fields (the cgroup the tree was in), never from the
    guard's name, which is "system" for a system rule and "PATH (GPU)" for a GPU rule."""
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


def job_of(meta: CheckpointMeta) -> dict[str, Any]:
    """A checkpoint's job as people know it: its own command (`oomguard exec`'s CMD, not the
    init that ran it) and its main process (the PID `ps` showed), beside the tree's `command`
    and `pid`: each where it differs from those (a job not started with `oomguard exec`)."""
    found: dict[str, Any] = {}
    if job_command(meta.job_command, meta.command) != meta.command:
        found["job_command"] = job_command(meta.job_command, meta.command)
    if meta.job_pid is not None and meta.job_pid != meta.pid:
        found["job_pid"] = meta.job_pid
    return found


def hook_fields(fields: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """The fields a hook's environment is made of (scalars only; names as documented)."""
    return {k: v for k, v in fields.items() if isinstance(v, str | int | float | bool)}


def _uid(uid: object) -> int | None:
    return uid if isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0 else None


@dataclass(frozen=True)
class CheckpointDone:
    """A tree dumped and committed: by a rule's action (`victim`, `path`, `usage_after`) or
    on request over the socket (`requested_by`, the caller's uid). Only a rule's tells Slurm."""

    name: ClassVar[str] = "checkpoint.done"
    level: ClassVar[str] = "warning"

    meta: CheckpointMeta
    timings: CheckpointTimings
    victim: VictimFields = field(default_factory=dict)
    path: str = ""  # a rule's: the checkpoint's directory
    usage_after: int | None = None  # a rule's: the cgroup's usage once the tree was gone
    requested_by: int | None = None  # None: a rule's

    @property
    def id(self) -> str:
        return self.meta.id

    @property
    def pid(self) -> int:
        return self.meta.pid

    @property
    def uid(self) -> int | None:  # the tree's owner (told over D-Bus), None where unknown
        return _uid(self.meta.uid)

    @property
    def command(self) -> str:  # the job's own (not oomguard exec's init): what a person gave
        return job_command(self.meta.job_command, self.meta.command)

    @property
    def reason(self) -> str:
        return SLURM_REASON

    @property
    def image_bytes(self) -> int:
        return max(0, self.meta.image_bytes)

    @property
    def seconds(self) -> float:
        return round(self.timings.total_s, 3)

    @property
    def freed_bytes(self) -> int:  # the tree's resident memory when it was dumped
        return max(0, self.meta.rss_bytes)

    @property
    def slurm(self) -> SlurmStep | None:  # the Slurm job step a rule's checkpoint belonged to
        return slurm_owner(self.meta.extra) if self.requested_by is None else None

    @property
    def hook(self) -> HookFields:
        return hook_fields(self.log_fields())

    def log_fields(self) -> dict[str, Any]:
        meta, t = self.meta, self.timings
        if self.requested_by is not None:
            return {"id": meta.id, "pid": meta.pid, "comm": meta.comm,
                    "image_bytes": meta.image_bytes, "rss": meta.rss_bytes, "uid": meta.uid,
                    "command": meta.command, **job_of(meta), "requested_by": self.requested_by,
                    "restore": restore_command(meta.id), "seconds": round(t.total_s, 3),
                    "freeze_s": round(t.freeze_s, 4), "dump_s": round(t.dump_s, 4),
                    "commit_s": round(t.commit_s, 4),
                    **({"holders_s": round(t.holders_s, 4)} if t.holders_s else {})}
        return {"id": meta.id, "image_bytes": meta.image_bytes,
                "image": format_size(meta.image_bytes), "seconds": round(t.total_s, 3),
                "freeze_s": round(t.freeze_s, 3), "dump_s": round(t.dump_s, 3),
                "commit_s": round(t.commit_s, 3),
                **({"holders_s": round(t.holders_s, 3)} if t.holders_s else {}),
                "mb_per_s": round(meta.image_bytes / 1e6 / t.dump_s, 1) if t.dump_s else None,
                "usage_after": self.usage_after, "path": self.path, "uid": meta.uid,
                "command": meta.command, **job_of(meta), "restore": restore_command(meta.id),
                **owner_of_meta(meta.extra), **self.victim}


@dataclass(frozen=True)
class CheckpointFailed:
    name: ClassVar[str] = "checkpoint.failed"
    level: ClassVar[str] = "error"

    outcome: str  # thawed, untouched, ... (model.errors.FailedCheckpoint)
    error: str
    victim: VictimFields = field(default_factory=dict)

    def log_fields(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "error": self.error, **self.victim}


@dataclass(frozen=True)
class CheckpointRefused:
    name: ClassVar[str] = "checkpoint.refused"
    level: ClassVar[str] = "error"

    reason: str
    victim: VictimFields = field(default_factory=dict)

    def log_fields(self) -> dict[str, Any]:
        return {"reason": self.reason, **self.victim}


@dataclass(frozen=True)
class RestoreDone:
    """A checkpoint running again: the daemon's auto-restore (`guard`, the guard's name) or a
    person's, over the socket (`requested_by`, the caller's uid)."""

    name: ClassVar[str] = "restore.done"
    level: ClassVar[str] = "warning"

    result: RestoreResult
    guard: str | None = None
    requested_by: int | None = None  # None: the daemon's auto-restore

    @property
    def auto(self) -> bool:
        return self.requested_by is None

    @property
    def id(self) -> str:
        return self.result.meta.id

    @property
    def pid(self) -> int:
        return self.result.pid

    @property
    def uid(self) -> int | None:
        return _uid(self.result.meta.uid)

    @property
    def command(self) -> str:  # the job's own (not oomguard exec's init)
        return job_command(self.result.meta.job_command, self.result.meta.command)

    @property
    def hook(self) -> HookFields:
        return hook_fields(self.log_fields())

    def log_fields(self) -> dict[str, Any]:
        r, meta = self.result, self.result.meta
        if self.requested_by is None:
            return {"id": meta.id, "pid": r.pid, "auto": True, "cgroup": self.guard,
                    "seconds": round(r.seconds, 3), "uid": meta.uid, "command": meta.command,
                    **job_of(meta)}
        return {"id": meta.id, "pid": r.pid, "auto": False, "seconds": round(r.seconds, 3),
                "verify_s": round(r.verify_s, 3), "lazy": r.lazy,
                "lazy_fallback": r.lazy_fallback, "warmed_bytes": r.warmed_bytes or None,
                "uid": meta.uid, "command": meta.command, **job_of(meta),
                "cgroup": meta.restored_cgroup, "requested_by": self.requested_by}


@dataclass(frozen=True)
class RestoreFailed:
    """`failure`: the error in one line, and CRIU's own where it failed
    (lifecycle.restoreoutcome.failure_fields). Auto-restore: `cgroup` is the guard's name and it is
    retried in `retry_in_s`; on request (`requested_by`): the cgroup asked for, else the
    checkpoint's, and `uid` its owner where it could be read."""

    name: ClassVar[str] = "restore.failed"
    level: ClassVar[str] = "error"

    id: str
    failure: Mapping[str, str]
    cgroup: str | None = None
    retry_in_s: float | None = None
    uid: int | None = None
    requested_by: int | None = None  # None: the daemon's auto-restore

    @property
    def auto(self) -> bool:
        return self.requested_by is None

    @property
    def error(self) -> str:
        return self.failure.get("error", "")

    def log_fields(self) -> dict[str, Any]:
        if self.requested_by is None:
            return {"id": self.id, "cgroup": self.cgroup, "auto": True,
                    "retry_in_s": self.retry_in_s, **self.failure}
        return {"id": self.id, "auto": False, "cgroup": self.cgroup, "uid": self.uid,
                "requested_by": self.requested_by, **self.failure}


@dataclass(frozen=True)
class VictimKilled:
    name: ClassVar[str] = "victim.killed"
    level: ClassVar[str] = "error"

    reason: str
    sigkill: int  # how many were still there after the grace
    victim: VictimFields = field(default_factory=dict)

    @property
    def pid(self) -> int:
        pid = self.victim.get("pid")
        return pid if isinstance(pid, int) else 0

    @property
    def hook(self) -> HookFields:
        return hook_fields(self.log_fields())

    def log_fields(self) -> dict[str, Any]:
        return {"reason": self.reason, "sigkill": self.sigkill, "explanation": KILLED,
                **self.victim}


@dataclass(frozen=True)
class VictimFrozen:
    name: ClassVar[str] = "victim.frozen"
    level: ClassVar[str] = "info"

    detect_to_frozen_ms: float  # from the crossing's wake-up to the tree stopped
    choose_ms: float  # reading and ranking the trees
    freeze: Mapping[str, object] = field(default_factory=dict)  # how (act.frozen.Frozen)
    victim: VictimFields = field(default_factory=dict)

    @property
    def detect_to_frozen_s(self) -> float:
        return max(0.0, self.detect_to_frozen_ms) / 1000

    def log_fields(self) -> dict[str, Any]:
        return {"detect_to_frozen_ms": self.detect_to_frozen_ms, "choose_ms": self.choose_ms,
                **self.freeze, **self.victim}


Event = (CheckpointDone | CheckpointFailed | CheckpointRefused | RestoreDone | RestoreFailed
         | VictimKilled | VictimFrozen)
# The events a user's hook runs on, by hook name (config [daemon.hooks]).
HOOK_OF: dict[type, str] = {CheckpointDone: "on_checkpoint", RestoreDone: "on_restore",
                            VictimKilled: "on_kill"}


class EventSink(Protocol):
    """Where a part of the daemon publishes what happened (the daemon's: logsetup's
    RecordingLogger, which writes the line and hands the event on)."""

    def publish(self, event: Event) -> None: ...


class LogSink:
    """The line alone, through a logger the caller was given: the sink of a part given a log
    and no sink (outside the daemon, or a test's)."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def publish(self, event: Event) -> None:
        getattr(self.log, event.level)(event.name, **event.log_fields())


def sink_for(log: Any, events: EventSink | None = None) -> EventSink:
    """The sink a part publishes to: the one it was given, else its log where that is a sink
    too (the daemon's RecordingLogger: nothing is lost to a wiring that forgot `events`),
    else the line alone (LogSink)."""
    from oomguard.observe.logsetup import RecordingLogger

    if events is not None:
        return events
    return log if isinstance(log, RecordingLogger) else LogSink(log)
