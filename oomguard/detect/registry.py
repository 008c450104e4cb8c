"""Every detection plug-in, in the order their reasons are asked for (the first that has one
names why a rule acts). A new one: its module in oomguard/detect/, and a line here. The
functions read SYSTEM_SIGNALS when called (`signals=None`), so the config, the examiner and the
startup line always agree on the plug-ins."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from oomguard.detect import memavailable, psifull
from oomguard.detect.base import Key, Settings, SystemReadings, SystemSignal

SYSTEM_SIGNALS: tuple[SystemSignal, ...] = (
    memavailable.SIGNAL,
    psifull.SIGNAL,
)


def _chosen(signals: Iterable[SystemSignal] | None) -> Iterable[SystemSignal]:
    return SYSTEM_SIGNALS if signals is None else signals


def keys_of(signals: Iterable[SystemSignal] | None = None) -> tuple[Key, ...]:
    return tuple(key for signal in _chosen(signals) for key in signal.keys)


def defaults(signals: Iterable[SystemSignal] | None = None) -> dict[str, Any]:
    return {key.name: key.default for key in keys_of(signals)}


def first_reason(readings: SystemReadings, settings: Settings,
                 signals: Iterable[SystemSignal] | None = None) -> str | None:
    """The reason of the first plug-in that has one, or None (the later are not asked, so
    their readings are not taken)."""
    for signal in _chosen(signals):
        reason = signal.judge(readings, settings)
        if reason is not None:
            return reason
    return None


def descriptions(settings: Settings, mem_total: int,
                 signals: Iterable[SystemSignal] | None = None) -> list[str]:
    return [text for signal in _chosen(signals)
            if (text := signal.describe(settings, mem_total)) is not None]
