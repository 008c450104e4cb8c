"""One look at the machine for the system rules' detections (oomguard.detect.base
SystemReadings): memory as psutil reads it (MemAvailable, MemTotal), and /proc/pressure/memory
read only when a detection asks for it."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from oomguard.model.pressure import Pressure, parse_pressure

PRESSURE_FILE = Path("/proc/pressure/memory")


class SystemLook:
    """`memory`: what psutil.virtual_memory() gave for this look (`available`, `total`)."""

    def __init__(self, memory: Any, pressure_file: Path = PRESSURE_FILE) -> None:
        self.memory = memory
        self.pressure_file = pressure_file

    @property
    def available(self) -> int:
        return int(self.memory.available)

    @property
    def total(self) -> int:
        return int(self.memory.total)

    @cached_property
    def memory_pressure(self) -> Pressure | None:
        """None where the kernel has no PSI (or the file cannot be read or parsed)."""
        try:
            return parse_pressure(self.pressure_file.read_text())
        except (OSError, ValueError):
            return None
