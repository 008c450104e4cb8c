"""System-wide rules (no per-cgroup limits, a workstation): MemAvailable against a floor, like
earlyoom. The pieces that are pure functions of the numbers."""

from __future__ import annotations

from oomguard.model.units import format_size

# Poll MemAvailable the way earlyoom does: the closer to the floor, the more often; it assumes
# memory can be eaten at up to 6 GB/s (earlyoom's figure).
WORST_GROWTH_BYTES_PER_S = 6e9
SYSTEM_MAX_POLL = 1.0


def floor_bytes(total: int, floor: float | int) -> int:
    return int(total * floor) if isinstance(floor, float) else floor


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


def floor_reason(available: int, floor: float | int) -> str:
    if isinstance(floor, float):
        return (f"MemAvailable {format_size(available)} at or below the floor "
                f"({floor:.0%} of MemTotal)")
    return f"MemAvailable {format_size(available)} at or below {format_size(floor)}"


def in_cgroups(rel_path: str, mount: str, roots: tuple[str, ...]) -> bool:
    """Is a process whose memory cgroup is `rel_path` at or below one of `roots` (filesystem
    paths under `mount`, or hierarchy paths)?"""
    for root in roots:
        inner = root[len(mount):] if mount and root.startswith(mount) else root
        inner = "/" + inner.strip("/")
        if inner == "/" or rel_path == inner or rel_path.startswith(inner + "/"):
            return True
    return False


def pressure_reason(full_avg10: float, threshold: float | None) -> str | None:
    """systemd-oomd's measure: the share of the last 10 s in which every task waited on memory
    ("full" avg10, in percent in the kernel's file) at or above `threshold` (a fraction)."""
    if threshold is None or full_avg10 / 100 < threshold:
        return None
    return f"memory pressure: full avg10 {full_avg10:.1f}% >= {threshold:.0%}"
