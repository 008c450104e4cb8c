"""Every detection plug-in, in the order their reasons are asked for (the first that has one
names why a rule acts): the system rules' (SYSTEM_SIGNALS), the cgroup rules' beside their
threshold (CGROUP_SIGNALS), and any rule's on the GPUs' memory (GPU_SIGNALS). A new one: its
module in oomguard/detect/, and a line here. The functions read these lists when called, so
the config, the examiner, the arming, the GPU watch and the startup line always agree on the
plug-ins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.detect import gputhreshold, memavailable, psifull, timetolimit
from oomguard.detect.base import (
    CgroupReadings,
    CgroupSignal,
    GpuReadings,
    GpuSignal,
    GpuVerdict,
    Key,
    Settings,
    SystemReadings,
    SystemSignal,
)

SYSTEM_SIGNALS: tuple[SystemSignal, ...] = (
    memavailable.SIGNAL,
    psifull.SIGNAL,
)
CGROUP_SIGNALS: tuple[CgroupSignal, ...] = (
    timetolimit.SIGNAL,
)
GPU_SIGNALS: tuple[GpuSignal, ...] = (
    gputhreshold.SIGNAL,
)


def memory_keys() -> tuple[Key, ...]:
    """The system and cgroup rules' plug-ins' keys."""
    system = tuple(key for signal in SYSTEM_SIGNALS for key in signal.keys)
    return system + tuple(key for signal in CGROUP_SIGNALS for key in signal.keys)


def gpu_keys() -> tuple[Key, ...]:
    """The GPU plug-ins' keys."""
    return tuple(key for signal in GPU_SIGNALS for key in signal.keys)


def keys_of() -> tuple[Key, ...]:
    """Every plug-in's keys, system, cgroup and GPU alike (a rule holds them all)."""
    return memory_keys() + gpu_keys()


def defaults() -> dict[str, Any]:
    return {key.name: key.default for key in keys_of()}


# -- the system rules' ---------------------------------------------------------------------------

def first_reason(readings: SystemReadings, settings: Settings) -> str | None:
    """The reason of the first plug-in that has one, or None (the later are not asked, so
    their readings are not taken)."""
    for signal in SYSTEM_SIGNALS:
        reason = signal.judge(readings, settings)
        if reason is not None:
            return reason
    return None


def descriptions(settings: Settings, mem_total: int) -> list[str]:
    return [text for signal in SYSTEM_SIGNALS
            if (text := signal.describe(settings, mem_total)) is not None]


# -- the cgroup rules' ---------------------------------------------------------------------------

def cgroup_signals() -> tuple[CgroupSignal, ...]:
    return CGROUP_SIGNALS


def judge_cgroup(readings: CgroupReadings, settings: Settings, states: Mapping[str, Any],
                 ) -> tuple[CgroupSignal | None, str | None, dict[str, Any]]:
    """Every cgroup plug-in judges the look (each keeps its own history), the first with a
    reason names it: (that plug-in, its reason, the states for the next look)."""
    found: tuple[CgroupSignal | None, str | None] = (None, None)
    kept = dict(states)
    for signal in CGROUP_SIGNALS:
        reason, kept[signal.name] = signal.judge(readings, settings, states.get(signal.name))
        if reason is not None and found[1] is None:
            found = (signal, reason)
    return found[0], found[1], kept


def polling(states: Mapping[str, Any]) -> bool:
    """Whether a cgroup plug-in wants the guard looked at every poll_interval."""
    return any(signal.polls(states.get(signal.name)) for signal in CGROUP_SIGNALS)


def after_action(states: Mapping[str, Any]) -> dict[str, Any]:
    """The states once the rule has acted."""
    return {signal.name: signal.after_action(states.get(signal.name))
            for signal in CGROUP_SIGNALS}


def watched_from(settings: Settings) -> list[float]:
    """The shares of the limit from which the cgroup plug-ins on in `settings` watch."""
    return [share for signal in CGROUP_SIGNALS
            if (share := signal.watched_from(settings)) is not None]


def cgroup_descriptions(settings: Settings) -> list[str]:
    return [text for signal in CGROUP_SIGNALS if (text := signal.describe(settings)) is not None]


# -- the GPUs' -----------------------------------------------------------------------------------

def gpu_watching(settings: Settings) -> bool:
    """Whether a GPU plug-in is on in `settings` (NVML is read for the rule)."""
    return any(signal.on(settings) for signal in GPU_SIGNALS)


def judge_gpu(readings: GpuReadings, settings: Settings) -> GpuVerdict | None:
    """The verdict of the first GPU plug-in that has one, or None."""
    for signal in GPU_SIGNALS:
        verdict = signal.judge(readings, settings)
        if verdict is not None:
            return verdict
    return None


def gpu_descriptions(settings: Settings) -> list[str]:
    return [text for signal in GPU_SIGNALS if (text := signal.describe(settings)) is not None]
