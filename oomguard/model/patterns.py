"""Lists of regular expressions from the config (a rule's prefer / avoid / protect), compiled
once; bad ones are told by value."""

from __future__ import annotations

import re
from collections.abc import Iterable


def compile_patterns(values: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    patterns = []
    for value in values:
        if not isinstance(value, str):
            raise ValueError(f"expected a regular expression string, got {value!r}")
        try:
            patterns.append(re.compile(value))
        except re.error as exc:
            raise ValueError(f"bad regular expression {value!r}: {exc}") from None
    return tuple(patterns)
