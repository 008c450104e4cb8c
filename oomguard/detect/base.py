"""What a detection plug-in is: its config keys, its judgement of a look's readings, and its
words for the startup line."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from oomguard.model.pressure import Pressure

# A rule's values of a plug-in's keys, by key (every key present: the default where unset).
Settings = Mapping[str, Any]


@dataclass(frozen=True)
class Key:
    """One `[[guard]]` key a plug-in owns: its name, its converter (raises ValueError with a
    message fit to show after the key; an oomguard.model.quantities Quantity also hints at a
    missing unit) and its value when the rule does not set it."""

    name: str
    convert: Callable[[Any], Any]
    default: Any


class SystemReadings(Protocol):
    """One look's readings of the machine, each read on first use and then kept for the look
    (a plug-in that is off reads nothing)."""

    @property
    def available(self) -> int: ...  # MemAvailable, bytes

    @property
    def total(self) -> int: ...  # MemTotal, bytes

    @property
    def memory_pressure(self) -> Pressure | None: ...  # /proc/pressure/memory; None: no PSI


class SystemSignal(Protocol):
    """A system rule's detection: a reason to act, judged from a look's readings and the
    rule's settings."""

    name: str  # in events and the docs
    keys: tuple[Key, ...]

    def judge(self, readings: SystemReadings, settings: Settings) -> str | None:
        """Why the rule acts now (a reason for the events), or None."""
        ...

    def describe(self, settings: Settings, mem_total: int) -> str | None:
        """What it watches, in the words of the startup line ("MemAvailable is at or below
        10% of 23.5 GiB (2.3 GiB)"); None when the rule leaves it off."""
        ...
