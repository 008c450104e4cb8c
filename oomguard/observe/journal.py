"""Log lines for journald: native entries (a human MESSAGE, the event's fields as journal
fields), else JSON with a syslog priority prefix.

Under systemd the daemon sends each event to journald's native socket
(/run/systemd/journal/socket, systemd-journald.service(8), "Native Journal Protocol"): one
datagram of KEY=value lines (a value holding a newline is sent as KEY, a newline, its length
as 64-bit little endian, the value and a newline). MESSAGE is one line for people
(`journalctl -u oomguard`); OOMGUARD_EVENT, CHECKPOINT_ID, OOMGUARD_PID, OOMGUARD_UID,
OOMGUARD_CGROUP and every other field (OOMGUARD_<NAME>) are fields to select on
(`journalctl OOMGUARD_EVENT=checkpoint.done`). When the socket is not there, or a datagram
is refused, the line goes to stderr as before.

When a service's stderr is a journald stream, a line starting with "<N>" is stored with
PRIORITY=N and the prefix stripped (sd-daemon(3); SyslogLevelPrefix= is on by default), so
`journalctl -p warning` works. Whether stderr is such a stream: systemd sets
$JOURNAL_STREAM to "DEV:INODE" of the stream, to be compared with fstat() of the fd
(systemd.exec(5)); the variable alone is not enough, as children inherit it after their
stderr was redirected elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

# sd-daemon(3) SD_* priorities
SD_ERR = 3
SD_WARNING = 4
SD_NOTICE = 5
SD_INFO = 6
SD_DEBUG = 7

PRIORITIES: Mapping[str, int] = {
    "critical": SD_ERR,
    "exception": SD_ERR,
    "error": SD_ERR,
    "warning": SD_WARNING,
    "warn": SD_WARNING,
    "notice": SD_NOTICE,
    "info": SD_INFO,
    "debug": SD_DEBUG,
}


def priority_for(level: str, default: int = SD_INFO) -> int:
    return PRIORITIES.get(level.lower(), default)


def syslog_prefix_renderer(
    serializer: Callable[..., str | bytes] = json.dumps, default_priority: int = SD_INFO,
) -> Callable[[WrappedLogger, str, EventDict], str]:
    """A final structlog processor: the event dict as one JSON line, prefixed "<N>".

    The level comes from the "level" key (structlog.processors.add_log_level), else from the
    method name; an unknown level gets `default_priority`. JSON escapes newlines, so an event
    stays one journal entry; a serializer must keep that property (no `indent`).
    """
    render = structlog.processors.JSONRenderer(serializer=serializer)

    def processor(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> str:
        level = event_dict.get("level", method_name)
        prio = priority_for(level if isinstance(level, str) else method_name, default_priority)
        body = render(logger, method_name, event_dict)
        if isinstance(body, bytes):
            body = body.decode("utf-8", "replace")
        return f"<{prio}>{body}"

    return processor


def under_journald(environ: Mapping[str, str] = os.environ, stderr_fd: int = 2) -> bool:
    """True when $JOURNAL_STREAM ("DEV:INODE", decimal) names the file open on `stderr_fd`."""
    dev_text, sep, ino_text = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (sep and _decimal(dev_text) and _decimal(ino_text)):
        return False
    try:
        st = os.fstat(stderr_fd)
    except OSError:  # closed or invalid fd
        return False
    return (st.st_dev, st.st_ino) == (int(dev_text), int(ino_text))


def _decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()


JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
IDENTIFIER = "oomguard"
# What an event is about, as fields of their own name (the rest are OOMGUARD_<NAME>).
NAMED_FIELDS: Mapping[str, str] = {"event": "OOMGUARD_EVENT", "id": "CHECKPOINT_ID",
                                   "checkpoint_id": "CHECKPOINT_ID", "pid": "OOMGUARD_PID",
                                   "uid": "OOMGUARD_UID", "cgroup": "OOMGUARD_CGROUP"}
SKIPPED = frozenset({"level", "timestamp"})  # the journal has its own PRIORITY and time
_NOT_NAME = re.compile(r"[^A-Z0-9_]")
FIELD_NAME_MAX = 64


def field_name(key: str) -> str:
    """An event's key as a journal field name: OOMGUARD_ and the key in capitals, anything
    but A-Z, 0-9 and _ turned into _ (journal field names allow nothing else)."""
    return NAMED_FIELDS.get(key) or \
        ("OOMGUARD_" + _NOT_NAME.sub("_", key.upper()))[:FIELD_NAME_MAX]


def field_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, default=str, sort_keys=True)


def human_message(event_dict: Mapping[str, Any], width: int = 400) -> str:
    """One line for people: the event's name, what it is about, then its other fields (sizes
    and times as people read them), its explanation last."""
    from oomguard.observe.rendering import event_fields, one_line

    explanation = event_dict.get("explanation")
    fields = {k: _flat(v) for k, v in event_dict.items()
              if k not in SKIPPED and k not in ("event", "explanation") and v is not None}
    line = f"{event_dict.get('event', '?')}: {event_fields(fields, width=width)}".rstrip(": ")
    if isinstance(explanation, str) and explanation:
        line += f" ({one_line(explanation, width)})"
    return line


def _flat(value: Any) -> Any:
    """A nested value as words, not JSON: {"a": 1, "b": [2, 3]} -> "a:1,b:2/3"."""
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{_flat(v)}" for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return "/".join(str(_flat(v)) for v in value)
    return value


def native_entry(event_dict: Mapping[str, Any], level: str) -> bytes:
    """One journal entry in the native protocol: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER and a
    field per key of the event."""
    pairs: list[tuple[str, str]] = [("MESSAGE", human_message(event_dict)),
                                    ("PRIORITY", str(priority_for(level))),
                                    ("SYSLOG_IDENTIFIER", IDENTIFIER)]
    seen = {"MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER"}
    for key, value in event_dict.items():
        name = field_name(key)
        if key in SKIPPED or value is None or name in seen:
            continue
        seen.add(name)
        pairs.append((name, field_value(value)))
    out = bytearray()
    for name, text in pairs:
        data = text.encode("utf-8", "replace")
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def journal_renderer(logger: Any, method_name: str,
                     event_dict: Any) -> tuple[tuple[tuple[bytes, str]], dict[str, Any]]:
    """The final structlog processor under journald: (args, kwargs) for the logger's call,
    whose one argument is the native entry and the JSON line (with its "<N>" prefix) to
    write instead if the entry cannot be sent."""
    level = event_dict.get("level", method_name)
    level = level if isinstance(level, str) else method_name
    entry = native_entry(event_dict, level)
    line = syslog_prefix_renderer()(logger, method_name, dict(event_dict))
    return ((entry, line),), {}


class JournalLogger:
    """structlog's wrapped logger under journald: `msg((entry, line))` sends `entry` to
    journald's native socket; if that fails (no socket, an entry too large for one datagram),
    writes `line` to `fallback` (the journal's stdout stream) instead."""

    def __init__(self, path: Path = JOURNAL_SOCKET, fallback: TextIO | None = None) -> None:
        self.path = path
        self.fallback = fallback or sys.stderr
        self._sock: socket.socket | None = None

    def msg(self, rendered: tuple[bytes, str]) -> None:
        entry, line = rendered
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(entry, str(self.path))
            return
        except OSError:
            pass
        self.fallback.write(line + "\n")
        self.fallback.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


class JournalLoggerFactory:
    def __init__(self, path: Path = JOURNAL_SOCKET, fallback: TextIO | None = None) -> None:
        self.logger = JournalLogger(path, fallback)

    def __call__(self, *args: Any) -> JournalLogger:
        return self.logger


def journal_socket_usable(path: Path = JOURNAL_SOCKET) -> bool:
    try:
        return path.is_socket()
    except OSError:
        return False
