"""Units people write in configs and flags, converted once to one internal unit each.

Sizes become bytes (int), durations seconds (float), percentages a fraction (float, 0 < f <= 1).
Parsers raise ValueError with a message fit to show after the key name.
"""

from __future__ import annotations

import math
import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?B?)?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_SCALE = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_size(value: str | int) -> int:
    """'512M', '2GiB', '1.5G', '4096' -> bytes. K/M/G are binary (1024) as in the kernel's files."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '512M' or '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"expected a size such as '512M' or '2GiB', got {value!r}")
    number, prefix, _ = match.groups()
    return int(float(number) * 1024 ** _SIZE_POWERS[prefix.upper()])


def parse_duration(value: str | int | float) -> float:
    """'150ms', '2s', '5m', '7d', 3 -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '150ms' or '2s', got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"a duration must be a finite number, got {value}")
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value}")
        return float(value)
    match = _DURATION_RE.match(str(value))
    if not match:
        raise ValueError(f"expected a duration such as '150ms' or '2s', got {value!r}")
    number, unit = match.groups()
    return float(number) * _DURATION_SCALE[unit]


# Upper bounds for every duration and size a config or flag may hold: anything above them is a
# typo, and some would not even run (an epoll timeout in ms overflows at about 24.8 days).
MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
MAX_WAIT = DAY  # a wait, timeout, grace or interval the daemon sleeps on
MAX_AGE = 3650 * DAY  # an age compared with timestamps, never slept on
MAX_SIZE = 1 << 50  # 1 PiB: above any machine's memory or a store's disk


def _describe_seconds(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    for unit, scale in (("d", DAY), ("h", HOUR), ("m", MINUTE), ("s", 1.0)):
        if seconds >= scale and seconds % scale == 0:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds * 1000:g}ms"


def bounded_duration(value: str | int | float, *, low: float = 0.0, high: float = MAX_WAIT,
                     positive: bool = False) -> float:
    """parse_duration within [low, high] (above 0 too when `positive`)."""
    seconds = parse_duration(value)
    if positive and seconds <= 0:
        raise ValueError(f"must be above 0, got {value!r}")
    if not low <= seconds <= high:
        raise ValueError(f"must be from {_describe_seconds(low)} to {_describe_seconds(high)}, "
                         f"got {value!r}")
    return seconds


def bounded_size(value: str | int, *, low: int = 0, high: int = MAX_SIZE) -> int:
    """parse_size within [low, high]."""
    size = parse_size(value)
    if not low <= size <= high:
        raise ValueError(f"must be from {format_size(low)} to {format_size(high)}, "
                         f"got {value!r}")
    return size


def parse_fraction(value: str | int | float) -> float:
    """'85%' or 0.85 -> 0.85. Must lie in (0, 1]."""
    if isinstance(value, bool):
        raise ValueError(f"expected a percentage such as '85%', got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise ValueError(f"expected a percentage such as '85%', got {value!r}") from None
    else:
        fraction = float(value)
    if not math.isfinite(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"must be above 0% and at most 100%, got {value!r}")
    return fraction


def format_size(n_bytes: float) -> str:
    """Bytes -> '1.5GiB' for humans."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


def size_text(n_bytes: float) -> str:
    """400 MiB, 1.5 GiB: whole MiB below a GiB (the daemon's startup lines)."""
    mib = n_bytes / (1 << 20)
    return f"{mib:.0f} MiB" if mib < 1024 else f"{mib / 1024:.1f} GiB"
