"""Whether a checkpoint fits back into a guarded cgroup now: the guard's threshold, not only
the limit, so a restore never lands straight back in the pressure that caused the checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.model.errors import NeverFits, NoRoom
from oomguard.policy.pressure import free_under_threshold, restore_fits


@dataclass(frozen=True)
class RestoreGuard:
    """What a rule guarding a cgroup says about restores into it."""

    path: Path  # the guarded cgroup's directory
    threshold: float  # the rule acts at this share of the limit
    margin: int  # bytes of room a restore must leave under the threshold (restore_margin)


# How the service learns which rule guards a cgroup (the daemon knows its rules; None in
# direct mode, where only the limit is checked).
GuardLookup = Callable[[MemoryCgroup], RestoreGuard | None]


def guard_for(cgroup: MemoryCgroup, guards: Iterable[RestoreGuard]) -> RestoreGuard | None:
    """The rule guarding `cgroup` (its exact directory), if any."""
    return next((g for g in guards if g.path == cgroup.path), None)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB"


def check_fits(checkpoint_id: str, cgroup: MemoryCgroup, snap: MemorySnapshot,
               image_bytes: int, guard: RestoreGuard) -> None:
    """Raise NoRoom, with the figures and the ways out, unless usage + image + margin stays
    under the guard's threshold (the auto-restore rule, policy.restore_fits)."""
    if restore_fits(snap, image_bytes, guard.margin, guard.threshold):
        return
    free = free_under_threshold(snap, guard.threshold) or 0
    assert snap.limit_bytes is not None  # restore_fits is True without a limit
    figures = (f"cannot restore {checkpoint_id} into {cgroup.path} now: its guard acts at "
               f"{guard.threshold:.0%} of {_mib(snap.limit_bytes)}, {_mib(max(free, 0))} are "
               f"free under that, and the checkpoint needs {_mib(image_bytes)} + "
               f"{_mib(guard.margin)} margin")
    if image_bytes + guard.margin > int(guard.threshold * snap.limit_bytes):
        raise NeverFits(f"{figures}, more than that even with nothing else in it (--wait "
                        "would wait forever). Restore into a bigger cgroup with --cgroup "
                        "PATH, raise its limit, or pass --force")
    raise NoRoom(
        f"{figures} (it would be checkpointed again at once). Restore into a bigger cgroup "
        "with --cgroup PATH, wait until it fits with --wait, or pass --force")
