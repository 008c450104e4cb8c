"""Checking a meta.json read from the store against CheckpointMeta's field types and sane
bounds, so that an entry a user or a failing disk mangled is refused whole instead of crashing
whatever reads one of its fields later (list, show, pruning, the daemon's start)."""

from __future__ import annotations

import math
from typing import Any

PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
INT_MAX = 1 << 62
FLOAT_MAX = 1e15  # times (epoch seconds), durations, byte counts: far above any real one
STR_MAX = 1 << 20
LIST_MAX = 1 << 16
PID_FIELDS = frozenset({"pid", "pids", "restored_pid", "gpu_pids", "stopped_nspids",
                        "job_pid"})


def _check_int(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name}: expected an integer, got {type(value).__name__}"
    low, high = (1, PID_MAX) if name in PID_FIELDS else (-INT_MAX, INT_MAX)
    if not low <= value <= high:
        return f"{name}: {value} is out of range"
    return None


def _check_float(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name}: expected a number, got {type(value).__name__}"
    if not math.isfinite(value) or abs(value) > FLOAT_MAX:
        return f"{name}: {value} is out of range"
    return None


def _check_str(name: str, value: Any) -> str | None:
    if not isinstance(value, str):
        return f"{name}: expected a string, got {type(value).__name__}"
    if len(value) > STR_MAX:
        return f"{name}: a string of {len(value)} characters is too long"
    return None


def _check_bool(name: str, value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{name}: expected true or false"


def _check_dict(name: str, value: Any) -> str | None:
    return None if isinstance(value, dict) else f"{name}: expected an object"


_SCALARS = {"int": _check_int, "float": _check_float, "str": _check_str, "bool": _check_bool,
            "dict[str, Any]": _check_dict}


def check_value(name: str, annotation: str, value: Any) -> str | None:
    """Why `value` does not fit the field `name` annotated `annotation` (a string: the module
    uses postponed annotations), or None. Unknown annotations are not checked."""
    kinds = [part.strip() for part in annotation.split("|")]
    if value is None:
        return None if "None" in kinds else f"{name}: null is not allowed"
    kinds = [k for k in kinds if k != "None"]
    if len(kinds) != 1:
        return None
    kind = kinds[0]
    if kind.startswith("list[") and kind.endswith("]"):
        if not isinstance(value, list):
            return f"{name}: expected a list, got {type(value).__name__}"
        if len(value) > LIST_MAX:
            return f"{name}: a list of {len(value)} items is too long"
        inner = kind[5:-1]
        for item in value:
            problem = check_value(name, inner, item)
            if problem is not None:
                return problem
        return None
    checker = _SCALARS.get(kind)
    return checker(name, value) if checker is not None else None
