"""Pressure stall information as the kernel writes it (/proc/pressure/memory, a cgroup's
memory.pressure): the numbers, parsed. Reading the files and the PSI triggers are
oomguard.sense.psi's; a detection (oomguard.detect) judges these numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PressureLine:
    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True)
class Pressure:
    some: PressureLine
    full: PressureLine | None


def parse_pressure(text: str) -> Pressure:
    lines: dict[str, PressureLine] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        values = dict(item.split("=", 1) for item in rest.split())
        try:
            lines[kind] = PressureLine(float(values["avg10"]), float(values["avg60"]),
                                       float(values["avg300"]), int(values["total"]))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"malformed pressure line: {line!r}") from exc
    if "some" not in lines:
        raise ValueError("pressure file has no 'some' line")
    return Pressure(some=lines["some"], full=lines.get("full"))
