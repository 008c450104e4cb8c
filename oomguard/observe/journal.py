"""Log lines for journald: JSON with a syslog priority prefix.

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
from collections.abc import Callable, Mapping

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
