"""The config file's value kinds: converters from TOML values, and the reader that applies them.

A converter raises ValueError with a message fit to show after the key. A Quantity (a share, a
size, a duration) also knows what a bare number lacks: `threshold = 85` is refused with
'did you mean "85%"?', and `headroom = 64` (64 bytes) is accepted with a warning.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from oomguard.config.actions import parse_chain
from oomguard.config.schema import GPU_PREFERENCES, ON_FAILURE_KILL, ON_FAILURE_THAW
from oomguard.model.errors import ConfigIssue
from oomguard.model.patterns import compile_patterns
from oomguard.model.units import (
    HOUR,
    MAX_AGE,
    bounded_duration,
    bounded_size,
    parse_fraction,
)

T = TypeVar("T")
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


class ConfigReader:
    """Pulls typed values out of TOML tables, recording an issue instead of raising, and
    which keys each table may hold (for the nearest-key hint on an unknown one)."""

    def __init__(self, source: str, issues: list[ConfigIssue]) -> None:
        self.source = source
        self.issues = issues
        self.warnings: list[ConfigIssue] = []
        self._known: dict[str, set[str]] = {}

    def know(self, prefix: str, key: str) -> None:
        self._known.setdefault(prefix, set()).add(key)

    def take(self, table: dict[str, Any], prefix: str, key: str, convert: Callable[[Any], T],
             default: T) -> T:
        self.know(prefix, key)
        if key not in table:
            return default
        value = table.pop(key)
        try:
            result = convert(value)
        except (ValueError, TypeError) as exc:
            hint = convert.hint(value) if isinstance(convert, Quantity) else None
            self.issues.append(ConfigIssue(self.source, f"{prefix}{key}",
                                           f"{exc} ({hint})" if hint else str(exc)))
            return default
        doubt = convert.doubt(value, result) if isinstance(convert, Quantity) else None
        if doubt:
            self.warnings.append(ConfigIssue(self.source, f"{prefix}{key}", doubt))
        return result

    def leftovers(self, table: dict[str, Any], prefix: str) -> None:
        known = sorted(self._known.get(prefix, ()))
        for key in table:
            near = difflib.get_close_matches(key, known, n=1)
            reason = f"unknown key (did you mean '{near[0]}'?)" if near else "unknown key"
            self.issues.append(ConfigIssue(self.source, f"{prefix}{key}", reason))


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def nonempty_str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def absolute_path(value: Any) -> str:
    """A non-empty string naming an absolute path."""
    text = nonempty_str(value)
    if not text.startswith("/"):
        raise ValueError(f"expected an absolute path, got {value!r}")
    return text


def mount_namespace_value(value: Any) -> str:
    """criu.mount_namespace: "auto", "off", or an absolute path (a namespace file)."""
    if value in ("auto", "off"):
        return str(value)
    if isinstance(value, str) and value.startswith("/") and "\0" not in value:
        return value
    raise ValueError(f'expected "auto", "off" or an absolute path such as "/proc/1/ns/mnt", '
                     f"got {value!r}")


def choice(value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(repr(c) for c in choices)}, "
                         f"got {value!r}{_nearest(value, choices)}")
    return str(value)


def _nearest(value: Any, choices: tuple[str, ...]) -> str:
    """" (did you mean 'avoid'?)" for a misspelt choice, else ""."""
    near = difflib.get_close_matches(value, choices, n=1) if isinstance(value, str) else []
    return f" (did you mean {near[0]!r}?)" if near else ""


def on_failure(value: Any) -> str:
    if value not in (ON_FAILURE_THAW, ON_FAILURE_KILL):
        raise ValueError(f"expected 'thaw' or 'kill', got {value!r}"
                         f"{_nearest(value, (ON_FAILURE_THAW, ON_FAILURE_KILL))}")
    return str(value)


def cgroup_list(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"expected a cgroup path or a list of them, got {value!r}")
    for item in items:
        if not item.startswith("/"):
            raise ValueError(f"cgroup paths must be absolute, got {item!r}")
        if ".." in item.split("/"):
            raise ValueError(f"cgroup paths may not contain '..', got {item!r}")
    return tuple(items)


def table(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a table ([{what}]), got {type(value).__name__}")
    return dict(value)


def guard_array(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError("expected [[guard]] tables")
    return value


def url(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        raise ValueError(f"expected an http(s):// URL, got {value!r}")
    return value


def factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 16:
        raise ValueError(f"expected a number from 1 to 16, got {value!r}")
    return float(value)


def call_rate_value(value: Any) -> float:
    """Control calls a second per user: 1 to 10000."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 10000:
        raise ValueError(f"expected calls a second from 1 to 10000, got {value!r}")
    return float(value)


def zstd_level(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 19:
        raise ValueError(f"expected a zstd level from 1 to 19, got {value!r}")
    return value


def port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"expected a TCP port number (0: off), got {value!r}")
    return value


def niceness(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -20 <= value <= 0:
        raise ValueError(f"expected a niceness from -20 to 0 (0: the ordinary priority), "
                         f"got {value!r}")
    return value


def regex_list(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError(f"expected a regular expression or a list of them, got {value!r}")
    compile_patterns(items)
    return tuple(items)


# -- quantities ------------------------------------------------------------------------------

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


def positive_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ValueError(f"expected a whole number from 1 to 1000, got {value!r}")
    return value


SIZE_SHARE_OR_NONE = Quantity(_size_share_or_none, ("M", "%"), _SIZE_WORDS + _SHARE_WORDS,
                              counts_bytes=True)
DURATION_OR_NONE = Quantity(_duration_or_none, ("s", "ms"), _DURATION_WORDS)
SIZE_OR_SHARE = Quantity(_size_or_fraction, ("%", "M"), _SHARE_WORDS + _SIZE_WORDS,
                         counts_bytes=True)


# Every [[guard]] key but cgroups/system/min_available (read first: they depend on each
# other), with its converter; defaults come from GuardConfig.
GUARD_KEYS: dict[str, Callable[[Any], Any]] = {
    "threshold": SHARE, "headroom": size(), "user_headroom": boolean, "on_failure": on_failure,
    "events": boolean, "memory_high": boolean, "freeze_cgroup": boolean, "psi": boolean,
    "oom_kill_disable": boolean, "park_deadline": PARK_DEADLINE,
    "victim_cgroups": cgroup_list, "psi_full_avg10": SHARE, "auto_restore": boolean,
    "restore_quiet": wait(), "restore_margin": size(), "actions": parse_chain,
    "prefer": regex_list, "avoid": regex_list, "protect": regex_list,
    "protect_session_leaders": boolean, "take_sessions": boolean, "post_action_delay": wait(),
    "time_to_limit": boolean, "predict_from": SHARE, "freeze_deadline": POSITIVE_DURATION,
    "kill_grace": wait(), "store_margin": size(), "restore_attempts": positive_count,
    "restore_retry": POSITIVE_DURATION,
    "gpu": lambda v: choice(v, GPU_PREFERENCES), "gpu_threshold": SHARE,
}
