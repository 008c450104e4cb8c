"""MemAvailable at or below a floor (earlyoom's rule): `min_available`, a share of MemTotal
("10%") or a size ("2G"). Always on for a system rule."""

from __future__ import annotations

from oomguard.detect.base import Key, Settings, SystemReadings
from oomguard.model.quantities import SIZE_OR_SHARE
from oomguard.model.units import format_size, size_text

MIN_AVAILABLE = "min_available"


def floor_bytes(total: int, floor: float | int) -> int:
    return int(total * floor) if isinstance(floor, float) else floor


def below_min_available(available: int, total: int, min_available: float | int) -> bool:
    """MemAvailable at or under the floor (a fraction of MemTotal, or bytes)."""
    return available <= floor_bytes(total, min_available)


def floor_reason(available: int, floor: float | int) -> str:
    if isinstance(floor, float):
        return (f"MemAvailable {format_size(available)} at or below the floor "
                f"({floor:.0%} of MemTotal)")
    return f"MemAvailable {format_size(available)} at or below {format_size(floor)}"


class MemAvailableFloor:
    name: str = "memavailable"
    keys: tuple[Key, ...] = (Key(MIN_AVAILABLE, SIZE_OR_SHARE, 0.10),)

    def judge(self, readings: SystemReadings, settings: Settings) -> str | None:
        floor = settings[MIN_AVAILABLE]
        if below_min_available(readings.available, readings.total, floor):
            return floor_reason(readings.available, floor)
        return None

    def describe(self, settings: Settings, mem_total: int) -> str | None:
        floor = settings[MIN_AVAILABLE]
        if isinstance(floor, float):
            return (f"MemAvailable is at or below {floor:.0%} of {size_text(mem_total)} "
                    f"({size_text(mem_total * floor)})")
        return f"MemAvailable is at or below {size_text(floor)}"


SIGNAL = MemAvailableFloor()
