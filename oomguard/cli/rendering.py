"""Output for people: sizes in KiB/MiB/GiB, times in local time, one checkpoint as an aligned
summary, the line a successful restore prints. Machines get the raw numbers (JSON output and
JSON log lines are never passed through here)."""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from oomguard.model.units import format_size

# Log and event fields that hold bytes (besides any field named *_bytes).
BYTE_FIELDS = frozenset({"usage", "limit", "anon", "resident", "vram", "rss", "available",
                         "total", "bytes", "min_available", "usage_after", "headroom",
                         "freed"})
LOCAL_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STATES_TO_RESTORE = ("checkpointed", "incomplete")


def is_byte_field(key: str) -> bool:
    return key in BYTE_FIELDS or key.endswith("_bytes")


def human_value(key: str, value: Any) -> Any:
    """A byte-valued field's integer as a size ('340.4MiB'), a Unix time (`*_at`) in local
    time; anything else unchanged."""
    if isinstance(value, bool):
        return value
    if is_byte_field(key) and isinstance(value, int):
        return format_size(value)
    if key.endswith("_at") and isinstance(value, (int, float)) and value > 0:
        return local_time(value, zone=False)
    return value


def local_time(epoch: float, zone: bool = True) -> str:
    """'2025-03-01 14:02:07 CET': a Unix time in this machine's local time."""
    moment = time.localtime(epoch)
    text = time.strftime(LOCAL_TIME_FORMAT, moment)
    return f"{text} {time.strftime('%Z', moment)}" if zone else text


def humanize_event(_logger: Any, _method: str,
                   event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor for the console (TTY) renderer: byte fields as sizes."""
    for key, value in list(event_dict.items()):
        event_dict[key] = human_value(key, value)
    return event_dict


def event_fields(event: Mapping[str, Any], skip: tuple[str, ...] = ("event", "time", "level")
                 ) -> str:
    """'cgroup=/jobs/a usage=380.0MiB ...': an event's fields for a line of `status`."""
    return " ".join(f"{k}={human_value(k, v)}" for k, v in event.items() if k not in skip)


def restore_command(checkpoint_id: str) -> str:
    """The command that brings `checkpoint_id` back."""
    return f"oomguard restore {shlex.quote(checkpoint_id)}"


def restored_line(result: Mapping[str, Any]) -> str:
    """'restored ID as PID N (was M) into CGROUP' from a Restore reply."""
    was = f" (was {result['was_pid']})" if result.get("was_pid") is not None else ""
    cgroup = result.get("cgroup")
    into = f" into {cgroup}" if cgroup else " (no cgroup)"
    return f"restored {result['id']} as PID {result['pid']}{was}{into}"


def _exit_text(meta: Mapping[str, Any]) -> str | None:
    if meta.get("exited_at") is None:
        return None
    how = f"with status {meta['exit_status']}" if meta.get("exit_status") is not None else \
        f"by {meta['exit_signal']}" if meta.get("exit_signal") else "(how unknown)"
    return f"{local_time(meta['exited_at'])} {how}"


def _how_to_restore(meta: Mapping[str, Any]) -> str:
    if meta.get("state") in STATES_TO_RESTORE:
        return restore_command(str(meta["id"]))
    if meta.get("state") == "restored":
        return "already restored"
    return f"not while {meta.get('state')}"


def show_rows(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A checkpoint's meta.json as (label, value) rows for people."""
    pids = list(meta.get("pids") or [])
    tasks = f" ({len(pids)} tasks)" if len(pids) > 1 else ""
    cgroup = meta.get("cgroup") or "(none)"
    rows = [
        ("id", str(meta["id"])),
        ("state", str(meta.get("state"))),
        ("command", str(meta.get("command"))),
        ("pid", f"{meta.get('pid')}{tasks}" + (" (PID namespace init)"
                                               if meta.get("pidns") else "")),
        ("user", f"{meta.get('user')} (uid {meta.get('uid')})"),
        ("cgroup", f"{cgroup} (cgroup v{meta.get('cgroup_version')})"),
        ("resident", format_size(meta.get("rss_bytes") or 0)),
        ("image", format_size(meta.get("image_bytes") or 0)),
    ]
    if meta.get("vram_bytes"):
        rows.append(("vram", format_size(meta["vram_bytes"])))
    rows.append(("created", local_time(meta["created"])))
    if meta.get("dump_seconds"):
        rows.append(("dump", f"{meta['dump_seconds']:.2f}s"))
    rows.append(("reason", str(meta.get("reason"))))
    if meta.get("restored_at") is not None:
        into = meta.get("restored_cgroup") or "(no cgroup)"
        rows.append(("restored", f"{local_time(meta['restored_at'])} as PID "
                                 f"{meta.get('restored_pid')} into {into}"))
    exited = _exit_text(meta)
    if exited:
        rows.append(("exited", exited))
    rows.append(("restore", _how_to_restore(meta)))
    return rows


def show_text(meta: Mapping[str, Any]) -> str:
    """`oomguard show ID` for people: one aligned 'label  value' line per row."""
    rows = show_rows(meta)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)
