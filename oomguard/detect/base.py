"""What a detection plug-in is: its config keys, its judgement of a look's readings, and its
words for the startup line. A system rule's (SystemSignal) judges the machine; a cgroup rule's
(CgroupSignal) judges one cgroup, and keeps a state of its own per guard from look to look (as
systemd-oomd passes the previous tick's data): a guard's look (oomguard.policy.guardlook) hands
it its state from the guard's history and keeps what it gives back in the next history. A GPU
one's (GpuSignal), any rule's, judges a read of the GPUs' memory (NVML's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


class CgroupReadings(Protocol):
    """One look at a guarded cgroup: its memory (a MemorySnapshot has these), when, and what
    this machine's dumps have shown they write per second."""

    @property
    def usage_bytes(self) -> int: ...

    @property
    def anon_bytes(self) -> int: ...

    @property
    def limit_bytes(self) -> int | None: ...

    @property
    def now(self) -> float: ...  # monotonic seconds

    @property
    def dump_throughput(self) -> float: ...  # bytes/s


class CgroupSignal(Protocol):
    """A cgroup rule's detection beside its threshold: a reason to act before the threshold is
    crossed. `state`: what it kept at the guard's last look (None at first)."""

    name: str
    keys: tuple[Key, ...]

    def judge(self, readings: CgroupReadings, settings: Settings,
              state: Any) -> tuple[str | None, Any]:
        """(why the rule acts now, or None; the state to keep for the next look)."""
        ...

    def polls(self, state: Any) -> bool:
        """Whether the guard must be looked at every poll_interval for it (no kernel event
        tells what it watches)."""
        ...

    def after_action(self, state: Any) -> Any:
        """The state once the rule has acted (what it saw before is no guide any more)."""
        ...

    def watched_from(self, settings: Settings) -> float | None:
        """The share of the limit from which it watches (None: off): the kernel wakes the
        daemon there (a v1 mark), and an action taken on its reason goes on while resident
        memory stays above it (or above the threshold, whichever is lower)."""
        ...

    def describe(self, settings: Settings) -> str | None:
        """Its words on the startup line ("earlier when growth would reach the limit first
        (watched from 50%)"); None when the rule leaves it off."""
        ...


class GpuDeviceReading(Protocol):
    """One GPU as a read of NVML shows it (an oomguard.gpu.nvml GpuDevice has these)."""

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def total_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...


class GpuReadings(Protocol):
    """One read of the GPUs (an oomguard.gpu.nvml GpuSnapshot has this)."""

    @property
    def devices(self) -> Sequence[GpuDeviceReading]: ...


@dataclass(frozen=True)
class GpuVerdict:
    """Why a rule acts on GPU memory: the devices pressed (their indexes, in the read's order)
    and the reason for the events."""

    devices: tuple[int, ...]
    reason: str


class GpuSignal(Protocol):
    """A detection on the GPUs' memory, for any rule: NVML has no events, so the daemon reads
    it (every [gpu] poll_interval) only while some rule has such a plug-in on."""

    name: str
    keys: tuple[Key, ...]

    def on(self, settings: Settings) -> bool:
        """Whether the rule has it on (NVML is read for it)."""
        ...

    def judge(self, readings: GpuReadings, settings: Settings) -> GpuVerdict | None:
        """The devices it finds pressed and why, or None (also when it is off)."""
        ...

    def describe(self, settings: Settings) -> str | None:
        """Its words on the startup line, after ", or " ("when a GPU's memory is 95% used");
        None when the rule leaves it off."""
        ...
