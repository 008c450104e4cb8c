"""The daemon's guards as `oomguard status` and systemd's STATUS= line show them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from oomguard.daemon.guards import CgroupGuard, Guard, SystemGuard
from oomguard.model.errors import CgroupGone
from oomguard.store.checkpoints import CheckpointMeta

STATUS_NAMES = 3  # guarded cgroups named in STATUS= (then "and N more")


def summary_line(guards: list[Guard], stored: Iterable[CheckpointMeta]) -> str:
    """One line for systemd's STATUS=."""
    present = [g for g in guards if g.present]
    waiting = sum(1 for m in stored if m.state == "checkpointed")
    named = ", ".join(g.name for g in present[:STATUS_NAMES])
    if len(present) > STATUS_NAMES:
        named += f" and {len(present) - STATUS_NAMES} more"
    return (f"guarding {len(present)} of {len(guards)} cgroup(s)"
            f"{': ' + named if named else ''}; "
            f"{waiting} checkpoint(s) waiting to be restored")


def guard_entries(guards: Iterable[Guard], meminfo: Callable[[], Any]) -> list[dict[str, Any]]:
    """Each guard: what it watches, how, and the memory there now."""
    entries = []
    for guard in guards:
        entry: dict[str, Any] = {"cgroup": guard.name, "detection": guard.detection,
                                 "threshold": guard.spec.threshold, "present": guard.present}
        if isinstance(guard, CgroupGuard) and guard.present:
            with contextlib.suppress(CgroupGone):
                snap = guard.cgroup.snapshot()
                entry.update(usage=snap.usage_bytes, limit=snap.limit_bytes,
                             anon=snap.anon_bytes, oom_kills=snap.oom_kills)
        elif isinstance(guard, SystemGuard):
            memory = meminfo()
            entry.update(usage=memory.total - memory.available, limit=memory.total,
                         threshold=1 - guard.spec.min_available
                         if isinstance(guard.spec.min_available, float) else 0.0)
        entries.append(entry)
    return entries
