"""Values with a unit, as people write them in configs: converters from TOML values that also
know what a bare number lacks. A converter raises ValueError with a message fit to show after
the key. `threshold = 85` is refused with 'did you mean "85%"?', and `headroom = 64` (64 bytes)
is accepted with a warning (Quantity.hint, Quantity.doubt). Below the config layer, so that a
detection plug-in (oomguard.detect) declares its keys' kinds itself."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from oomguard.model.units import (
    HOUR,
    MAX_AGE,
    bounded_duration,
    bounded_size,
    parse_fraction,
)


def boolean(value: Any) -> bool:
    """A TOML boolean (no quantity, but as plainly written: true or false)."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


_BARE_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*$")
_LEADING_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)")
TINY_SIZE = 1024  # a bare size below this many bytes was almost surely meant in another unit


def _number_text(value: Any) -> str | None:
    """The number a value starts with, as written ("85", "0.5"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value) if value >= 0 else None
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        match = _LEADING_NUMBER.match(value)
        return match.group(1) if match else None
    return None


def _is_bare_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) or (isinstance(value, str)
                                              and _BARE_NUMBER.match(value) is not None)


@dataclass(frozen=True)
class Quantity:
    """A converter for a value with a unit, and the unit it probably lacked when it refused one:
    a bare number gets each of `units` in turn, a number followed by a word it does not know
    ("10 sec", "512 megs") the unit of the first of `words` that word starts with. A guess is
    offered only when the converter accepts it."""

    parse: Callable[[Any], Any]
    units: tuple[str, ...]
    words: tuple[tuple[str, str], ...] = ()  # (how a word starts, the unit it means)
    counts_bytes: bool = False  # a bare number is bytes (a tiny one gets a warning)

    def __call__(self, value: Any) -> Any:
        return self.parse(value)

    def _suggest(self, number: str, units: Iterable[str]) -> str | None:
        for unit in units:
            candidate = f"{number}{unit}"
            try:
                self.parse(candidate)
            except (ValueError, TypeError):
                continue
            return candidate
        return None

    def _units_for(self, value: Any) -> list[str]:
        if _is_bare_number(value):
            return list(self.units)
        word = _LEADING_NUMBER.sub("", str(value)).strip().lower()
        return [unit for start, unit in self.words if word.startswith(start)][:1]

    def hint(self, value: Any) -> str | None:
        """'did you mean "85%"?' for a refused value, when its number with a unit would do."""
        number = _number_text(value)
        if number is None:
            return None
        candidate = self._suggest(number, self._units_for(value))
        return f'did you mean "{candidate}"?' if candidate else None

    def doubt(self, value: Any, result: Any) -> str | None:
        """A remark on an accepted value: a bare size of a few bytes."""
        if not self.counts_bytes or not _is_bare_number(value) or isinstance(result, float):
            return None
        number = _number_text(value)
        if number is None or not 0 < float(number) < TINY_SIZE:
            return None
        candidate = self._suggest(number, self.units)
        if candidate is None:
            return None
        return f'{number} bytes (did you mean "{candidate}"?)'


_SHARE_WORDS = (("percent", "%"), ("pct", "%"))
_SIZE_WORDS = (("k", "K"), ("m", "M"), ("g", "G"), ("t", "T"), ("p", "P"))
_DURATION_WORDS = (("milli", "ms"), ("ms", "ms"), ("sec", "s"), ("s", "s"), ("min", "m"),
                   ("m", "m"), ("h", "h"), ("d", "d"))

SHARE = Quantity(parse_fraction, ("%",), _SHARE_WORDS)


def wait(*, positive: bool = False, high: float | None = None, low: float = 0.0) -> Quantity:
    """A duration the daemon waits or sleeps on: bounded (huge values overflow epoll's and
    the thread waits' timeouts, and are typos anyway)."""
    top = {} if high is None else {"high": high}
    return Quantity(lambda value: bounded_duration(value, positive=positive, low=low, **top),
                    ("s", "ms"), _DURATION_WORDS)


POSITIVE_DURATION = wait(positive=True)
PARK_DEADLINE = wait(low=1.0, high=HOUR)  # a task must never stay parked for long: 1s to 1h


def size(*, low: int = 0) -> Quantity:
    return Quantity(lambda value: bounded_size(value, low=low), ("M",), _SIZE_WORDS,
                    counts_bytes=True)


def _duration_or_none(value: Any) -> float | None:
    if isinstance(value, str) and value.strip().lower() in ("none", "0"):
        return None
    return bounded_duration(value, high=MAX_AGE) or None


def _size_or_fraction(value: Any) -> float | int:
    """'10%' or 0.1 -> fraction of MemTotal; '2G' or an integer -> bytes (never 0)."""
    if isinstance(value, float) or (isinstance(value, str) and value.strip().endswith("%")):
        return parse_fraction(value)
    amount = bounded_size(value)
    if amount <= 0:
        raise ValueError(f"must be above 0 (a size such as '2G' or a share such as '10%'), "
                         f"got {value!r}")
    return amount


def _size_share_or_none(value: Any) -> int | float | None:
    """A store budget: '10%' or 0.1 -> a share of the store's file system; '20G' or an
    integer -> bytes; "0" or "none" -> no limit."""
    if isinstance(value, str) and value.strip().lower() in ("none", "0", "0%"):
        return None
    if isinstance(value, float) or (isinstance(value, str) and value.strip().endswith("%")):
        return parse_fraction(value)
    return bounded_size(value) or None


SIZE_SHARE_OR_NONE = Quantity(_size_share_or_none, ("M", "%"), _SIZE_WORDS + _SHARE_WORDS,
                              counts_bytes=True)
DURATION_OR_NONE = Quantity(_duration_or_none, ("s", "ms"), _DURATION_WORDS)
SIZE_OR_SHARE = Quantity(_size_or_fraction, ("%", "M"), _SHARE_WORDS + _SIZE_WORDS,
                         counts_bytes=True)
