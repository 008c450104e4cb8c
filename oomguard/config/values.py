"""The config file's value kinds: converters from TOML values, and the reader that applies them.

A converter raises ValueError with a message fit to show after the key. The values with a unit
(a share, a size, a duration: Quantity) are oomguard.model.quantities.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, TypeVar

from oomguard.config.actions import parse_chain
from oomguard.config.schema import GPU_PREFERENCES, ON_FAILURE_KILL, ON_FAILURE_THAW
from oomguard.model.errors import ConfigIssue
from oomguard.model.patterns import compile_patterns
from oomguard.model.quantities import (
    PARK_DEADLINE,
    POSITIVE_DURATION,
    SHARE,
    Quantity,
    boolean,
    size,
    wait,
)

T = TypeVar("T")


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


def argv_list(value: Any) -> tuple[str, ...]:
    """A command as its argv: a non-empty list of non-empty strings (no shell)."""
    if not isinstance(value, list) or not value or \
            not all(isinstance(i, str) and i for i in value):
        raise ValueError(f"expected a command as a list of strings, such as [\"podman\"], "
                         f"got {value!r}")
    return tuple(value)


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


def positive_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ValueError(f"expected a whole number from 1 to 1000, got {value!r}")
    return value



# Every [[guard]] key but cgroups/system (read first: they depend on each other) and the
# detection plug-ins' (oomguard.detect: they declare their own), with its converter; defaults
# come from GuardConfig.
GUARD_KEYS: dict[str, Callable[[Any], Any]] = {
    "threshold": SHARE, "headroom": size(), "user_headroom": boolean, "on_failure": on_failure,
    "events": boolean, "memory_high": boolean, "freeze_cgroup": boolean, "psi": boolean,
    "oom_kill_disable": boolean, "park_deadline": PARK_DEADLINE,
    "victim_cgroups": cgroup_list, "auto_restore": boolean,
    "restore_quiet": wait(), "restore_margin": size(), "actions": parse_chain,
    "prefer": regex_list, "avoid": regex_list, "protect": regex_list,
    "protect_session_leaders": boolean, "take_sessions": boolean, "post_action_delay": wait(),
    "freeze_deadline": POSITIVE_DURATION,
    "kill_grace": wait(), "store_margin": size(), "restore_attempts": positive_count,
    "restore_retry": POSITIVE_DURATION,
    "gpu": lambda v: choice(v, GPU_PREFERENCES),
}
