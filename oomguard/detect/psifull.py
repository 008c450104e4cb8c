"""Memory pressure (systemd-oomd's measure): the share of the last 10 s in which every task
waited on memory, PSI's "full" avg10, at or above `psi_full_avg10` (a share; unset: off)."""

from __future__ import annotations

from oomguard.detect.base import Key, Settings, SystemReadings
from oomguard.model.quantities import SHARE

PSI_FULL_AVG10 = "psi_full_avg10"


def pressure_reason(full_avg10: float, threshold: float | None) -> str | None:
    """`full_avg10` in percent, as in the kernel's file; `threshold` a fraction."""
    if threshold is None or full_avg10 / 100 < threshold:
        return None
    return f"memory pressure: full avg10 {full_avg10:.1f}% >= {threshold:.0%}"


class PsiFull:
    name: str = "psi_full"
    keys: tuple[Key, ...] = (Key(PSI_FULL_AVG10, SHARE, None),)

    def judge(self, readings: SystemReadings, settings: Settings) -> str | None:
        threshold = settings[PSI_FULL_AVG10]
        if threshold is None:
            return None  # off: /proc/pressure is not read for it
        pressure = readings.memory_pressure
        full = pressure.full.avg10 if pressure is not None and pressure.full is not None else 0.0
        return pressure_reason(full, threshold)

    def describe(self, settings: Settings, mem_total: int) -> str | None:
        threshold = settings[PSI_FULL_AVG10]
        if threshold is None:
            return None
        return f"memory pressure (full avg10) reaches {threshold:.0%}"


SIGNAL = PsiFull()
