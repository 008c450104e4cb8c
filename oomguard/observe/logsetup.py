"""structlog set-up for the daemon and the CLI: JSON lines when not on a TTY, console on a TTY.

structlog (and asyncio, which it loads, and logging) is imported at the first logger asked
for, not before: the CLI asks the daemon first and logs what came back (a restore's job runs
30 ms sooner)."""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from oomguard.observe.rendering import LOCAL_TIME_FORMAT, humanize_event

if TYPE_CHECKING:  # the daemon's; the CLI loads logsetup without them
    from oomguard.observe.events import Event
    from oomguard.observe.history import EventHistory

_pending: tuple[str, str, TextIO | None] | None = None  # configure_logging(lazily=True)'s


def configure_logging(fmt: str = "auto", level: str = "info", stream: TextIO | None = None,
                      *, lazily: bool = False) -> None:
    """fmt: 'auto' (console on a TTY, else JSON), 'json' or 'console'. `lazily`: at the first
    get_logger()."""
    global _pending
    if lazily:
        _pending = (fmt, level, stream)
        return
    _pending = None
    import logging

    import structlog

    from oomguard.observe.journal import (
        JournalLoggerFactory,
        journal_renderer,
        journal_socket_usable,
        syslog_prefix_renderer,
    )

    out = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    renderer: Any = (structlog.processors.JSONRenderer() if use_json
                     else structlog.dev.ConsoleRenderer(colors=out.isatty()))
    factory: Any = structlog.PrintLoggerFactory(file=out)
    if use_json and fmt == "auto" and _journald(out):
        # "<N>" first: journald turns it into the entry's PRIORITY (sd-daemon(3)).
        renderer = syslog_prefix_renderer()
        if journal_socket_usable():  # native entries: a line for people, fields to select on
            renderer, factory = journal_renderer, JournalLoggerFactory(fallback=out)
    # JSON: raw numbers and UTC ISO times, for machines. Console (a TTY): local time and
    # byte-valued fields as sizes, for people.
    people: list[Any] = [] if use_json else [humanize_event]
    stamper = structlog.processors.TimeStamper(fmt="iso", utc=True) if use_json else \
        structlog.processors.TimeStamper(fmt=LOCAL_TIME_FORMAT, utc=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamper,
            *people,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


def _journald(out: TextIO) -> bool:
    from oomguard.observe.journal import under_journald

    try:
        return under_journald(os.environ, out.fileno())
    except (OSError, ValueError, AttributeError):
        return False


def get_logger(**bound: Any) -> Any:
    import structlog

    if _pending is not None:
        configure_logging(*_pending)
    return structlog.get_logger("oomguard").bind(**bound)


class RecordingLogger:
    """The daemon's logger: it also keeps the last events of note (warnings and up, and
    checkpoints and restores) for `oomguard status`, and publishes the daemon's typed events
    (observe/events.py): each is handed to the tap (telemetry.EventTap.tell), then its line
    is written from it."""

    NOTABLE = ("checkpoint.", "restore.", "threshold.crossed", "oom.", "victim.", "store.")

    def __init__(self, log: Any, keep: int = 50,
                 tap: Callable[[Event], None] | None = None,
                 history: EventHistory | None = None) -> None:
        self.log = log
        self.tap = tap
        self.history = history  # kept in the store: a restarted daemon shows them too
        self.recent: deque[dict[str, Any]] = deque(
            history.load() if history is not None else [], maxlen=keep)

    def publish(self, event: Event) -> None:
        if self.tap is not None:
            self.tap(event)
        self._write(event.level, event.name, event.log_fields())

    def _write(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if level in ("warning", "error") or event.startswith(self.NOTABLE):
            keep = {k: v for k, v in fields.items()
                    if isinstance(v, str | int | float | bool) and k not in ("path",)}
            entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "level": level,
                     "event": event, **keep}
            self.recent.append(entry)
            if self.history is not None:
                self.history.append(entry, list(self.recent))
        getattr(self.log, level)(event, **fields)

    def debug(self, event: str, **fields: Any) -> None:
        self._write("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._write("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._write("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._write("error", event, fields)
