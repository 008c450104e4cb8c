"""The exception tree. Library modules raise these; only the daemon and the CLI log."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OomguardError(Exception):
    """Base of every error oomguard raises on purpose."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration: where it is and what is wrong."""

    source: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.reason}"


class ConfigError(OomguardError):
    """A configuration (file or flags) is invalid. Carries every issue found, not just the first."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


class CgroupGone(OomguardError):
    """The cgroup disappeared while we were looking at it (routine, not a crash)."""


class ProcessGone(OomguardError):
    """The process exited while we were looking at it (routine, not a crash)."""


class CriuError(OomguardError):
    """CRIU failed; `log_tail` holds the last lines of its log, which say why."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        self.log_tail = log_tail
        super().__init__(message if not log_tail else f"{message}\n{log_tail}")


class FailedCheckpoint(enum.StrEnum):
    """What became of the process when its checkpoint failed (the values are what events,
    the control socket and the CLI say)."""

    UNTOUCHED = "untouched"  # refused before the process was stopped: it never paused
    THAWED = "thawed"  # stopped, then thawed: it runs on where it was
    INCOMPLETE = "dumped, commit pending"  # gone, images intact, commit to be finished


class CheckpointFailed(OomguardError):
    """A checkpoint did not complete. `outcome` says what happened to the process; `lasting`,
    in one line, why no checkpoint of this tree can succeed while it lives ("" if another try
    might: oomguard.policy.unfit). `limit_busy`: why the limit lifted for the dump could not be
    put back after it failed (the tree grew into the room above its own limit; "" if it was)."""

    def __init__(self, message: str, outcome: FailedCheckpoint, lasting: str = "",
                 limit_busy: str = "") -> None:
        self.outcome = outcome
        self.lasting = lasting
        self.limit_busy = limit_busy
        super().__init__(message)


class TreeNotYours(CheckpointFailed):
    """An on-demand checkpoint refused once its tree had stopped: a task of it belongs to (or
    holds the rights of) another user, which it did not when the request was checked (a
    setuid exec in between). The tasks oomguard stopped were continued (outcome THAWED)."""


class StoreOverBudget(CheckpointFailed):
    """A checkpoint the store's budget has no room for (refused before the dump, or the disk
    filled during it): `budget`, the figures (used, cap, free, keep_free, in bytes)."""

    def __init__(self, message: str, outcome: FailedCheckpoint,
                 budget: dict[str, int | None], limit_busy: str = "") -> None:
        self.budget = budget
        super().__init__(message, outcome, limit_busy=limit_busy)


class RestoreFailed(OomguardError):
    """A restore did not happen; the checkpoint is left intact."""


class NoRoom(RestoreFailed):
    """The target cgroup has no room for the checkpoint now (under its guard's threshold, or
    under its limit); it may have later (`oomguard restore --wait`)."""


class NeverFits(NoRoom):
    """The checkpoint is larger than its target cgroup could ever hold (its limit, or its
    guard's threshold, with nothing else in it): waiting would not help."""


class BadInput(OomguardError):
    """What the command was given cannot be acted on (exit status 2)."""


class StoreError(OomguardError):
    """The checkpoint store cannot do what was asked (unknown id, bad id, unwritable...)."""


class AmbiguousId(StoreError):
    """A checkpoint id prefix matches more than one checkpoint; `candidates` are their ids."""

    def __init__(self, message: str, candidates: list[str]) -> None:
        self.candidates = candidates
        super().__init__(message)


class RestoreInProgress(StoreError):
    """Another restore (the daemon's, a person's, a lazy restore's keeper) holds the
    checkpoint: a race lost, not a failure of the checkpoint."""


class UnknownCheckpoint(StoreError):
    """No such checkpoint (or none the caller may see): a request for nothing, not a failure."""
