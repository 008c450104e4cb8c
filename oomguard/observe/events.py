"""The daemon's events that feed more than the log, as types: what a checkpoint, a restore, a
kill and a freeze tell the metrics, the hooks, D-Bus and Slurm. The daemon logs one event per
thing that happens (structlog, flat fields); `typed()` reads those fields once, here, and
every consumer takes the typed event instead of reading log fields itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard.sense.owners import SlurmStep

HookFields = Mapping[str, str | int | float | bool]


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _uid(fields: Mapping[str, Any]) -> int | None:
    uid = fields.get("uid")
    return uid if isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0 else None


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


def hook_fields(fields: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """The fields a hook's environment is made of (scalars only; names as documented)."""
    return {k: v for k, v in fields.items() if isinstance(v, str | int | float | bool)}


@dataclass(frozen=True)
class CheckpointDone:
    id: str
    pid: int
    uid: int | None  # the tree's owner (told over D-Bus), None where unknown
    command: str
    reason: str
    image_bytes: int
    seconds: float
    freed_bytes: int  # the tree's resident memory when it was dumped
    slurm: SlurmStep | None  # the Slurm job step it belonged to
    hook: HookFields = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointFailed:
    outcome: str  # thawed, untouched, ... (CheckpointFailed.outcome)
    error: str


@dataclass(frozen=True)
class CheckpointRefused:
    reason: str


@dataclass(frozen=True)
class RestoreDone:
    id: str
    pid: int
    uid: int | None
    command: str
    auto: bool  # the daemon's auto-restore, not a person's
    hook: HookFields = field(default_factory=dict)


@dataclass(frozen=True)
class RestoreFailed:
    id: str
    auto: bool
    error: str


@dataclass(frozen=True)
class VictimKilled:
    pid: int
    hook: HookFields = field(default_factory=dict)


@dataclass(frozen=True)
class VictimFrozen:
    detect_to_frozen_s: float | None  # from the crossing's wake-up to the tree stopped


Event = (CheckpointDone | CheckpointFailed | CheckpointRefused | RestoreDone | RestoreFailed
         | VictimKilled | VictimFrozen)
# The events a user's hook runs on, by hook name (config [daemon.hooks]).
HOOK_OF: dict[type, str] = {CheckpointDone: "on_checkpoint", RestoreDone: "on_restore",
                            VictimKilled: "on_kill"}


def typed(event: str, fields: Mapping[str, Any]) -> Event | None:
    """The typed event a log event is, or None for one that feeds only the log."""
    if event == "checkpoint.done":
        return CheckpointDone(str(fields.get("id", "")), _int(fields.get("pid")), _uid(fields),
                              str(fields.get("command", "")),
                              str(fields.get("reason") or "memory"),
                              max(0, _int(fields.get("image_bytes"))),
                              _float(fields.get("seconds")), max(0, _int(fields.get("rss"))),
                              slurm_owner(fields), hook_fields(fields))
    if event == "checkpoint.failed":
        return CheckpointFailed(str(fields.get("outcome", "")), str(fields.get("error", "")))
    if event == "checkpoint.refused":
        return CheckpointRefused(str(fields.get("reason", "")))
    if event == "restore.done":
        return RestoreDone(str(fields.get("id", "")), _int(fields.get("pid")), _uid(fields),
                           str(fields.get("command", "")), bool(fields.get("auto")),
                           hook_fields(fields))
    if event == "restore.failed":
        return RestoreFailed(str(fields.get("id", "")), bool(fields.get("auto")),
                             str(fields.get("error", "")))
    if event == "victim.killed":
        return VictimKilled(_int(fields.get("pid")), hook_fields(fields))
    if event == "victim.frozen":
        ms = fields.get("detect_to_frozen_ms")
        return VictimFrozen(None if ms is None else max(0.0, _float(ms)) / 1000)
    return None
