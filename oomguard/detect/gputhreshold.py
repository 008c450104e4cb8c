"""GPU memory at a share (`gpu_threshold`, "95%"): a device whose memory is at least that
share used is pressed. Off unless a rule sets it; NVML is read (every [gpu] poll_interval)
only while some rule does. Which tree is acted on is the daemon's (oomguard.daemon.gpuwatch:
the one holding the most memory on the pressed devices)."""

from __future__ import annotations

from collections.abc import Sequence

from oomguard.detect.base import GpuDeviceReading, GpuReadings, GpuVerdict, Key, Settings
from oomguard.model.quantities import SHARE
from oomguard.model.units import format_size

GPU_THRESHOLD = "gpu_threshold"


def devices_at(devices: Sequence[GpuDeviceReading], share: float) -> list[GpuDeviceReading]:
    """The devices whose used/total is at least `share` (a fraction, 0..1); a device that
    reports no memory is never pressed."""
    return [device for device in devices
            if device.total_bytes > 0 and device.used_bytes / device.total_bytes >= share]


def pressure_reason(devices: Sequence[GpuDeviceReading], share: float) -> str:
    return "; ".join(f"GPU {d.index} ({d.name}) memory {format_size(d.used_bytes)} of "
                     f"{format_size(d.total_bytes)} >= {share:.0%}" for d in devices)


class GpuThreshold:
    name: str = "gpu_threshold"
    keys: tuple[Key, ...] = (Key(GPU_THRESHOLD, SHARE, None),)

    def on(self, settings: Settings) -> bool:
        return settings[GPU_THRESHOLD] is not None

    def judge(self, readings: GpuReadings, settings: Settings) -> GpuVerdict | None:
        share = settings[GPU_THRESHOLD]
        if share is None:
            return None
        pressed = devices_at(readings.devices, share)
        if not pressed:
            return None
        return GpuVerdict(tuple(d.index for d in pressed), pressure_reason(pressed, share))

    def describe(self, settings: Settings) -> str | None:
        share = settings[GPU_THRESHOLD]
        return None if share is None else f"when a GPU's memory is {share:.0%} used"


SIGNAL = GpuThreshold()
