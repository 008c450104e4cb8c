"""System-wide rules (no per-cgroup limits, a workstation): when to look at MemAvailable again
and when to keep a ranking ready, like earlyoom, and which processes are in the rule's cgroups.
Whether to act is the detection plug-ins' (oomguard.detect)."""

from __future__ import annotations

from oomguard.detect.memavailable import floor_bytes

# Poll MemAvailable the way earlyoom does: the closer to the floor, the more often; it assumes
# memory can be eaten at up to 6 GB/s (earlyoom's figure).
WORST_GROWTH_BYTES_PER_S = 6e9
SYSTEM_MAX_POLL = 1.0


def next_poll(available: int, total: int, floor: float | int, min_interval: float) -> float:
    """Seconds until MemAvailable is looked at again."""
    distance = available - floor_bytes(total, floor)
    return min(SYSTEM_MAX_POLL, max(min_interval, distance / WORST_GROWTH_BYTES_PER_S))


PREPARE_MIN_BYTES = 512 << 20


def preparing(available: int, total: int, floor: float | int) -> bool:
    """Close enough to the floor to keep a ranking of the processes ready (within the floor
    again, and at least PREPARE_MIN_BYTES, above it)."""
    room = floor_bytes(total, floor)
    return available - room < max(room, PREPARE_MIN_BYTES)


def in_cgroups(rel_path: str, mount: str, roots: tuple[str, ...]) -> bool:
    """Is a process whose memory cgroup is `rel_path` at or below one of `roots` (filesystem
    paths under `mount`, or hierarchy paths)?"""
    for root in roots:
        inner = root[len(mount):] if mount and root.startswith(mount) else root
        inner = "/" + inner.strip("/")
        if inner == "/" or rel_path == inner or rel_path.startswith(inner + "/"):
            return True
    return False
