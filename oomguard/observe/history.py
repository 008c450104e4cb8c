"""The daemon's recent events of note (what `oomguard status` shows under its guards), kept in
the store so that a restarted daemon shows what happened before it: STORE/.history.jsonl,
one JSON object a line, root's alone (0600, in the root-only store), trimmed to its last
`keep` entries whenever it holds `trim_at` times as many."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from oomguard.model.atomicfile import write_atomically
from oomguard.store.names import HISTORY

HISTORY_NAME = HISTORY
READ_MAX = 1 << 20  # a history file larger than this (not written by us) is read from its end


class EventHistory:
    def __init__(self, store: Path, keep: int = 50, trim_at: int = 4) -> None:
        self.path = store / HISTORY_NAME
        self.keep = keep
        self.trim_at = trim_at
        self._lines = 0

    def load(self) -> list[dict[str, Any]]:
        """The last `keep` entries written, oldest first; lines that are not an object
        (a torn last write) are skipped; none when there is no history."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - READ_MAX))
            data = f.read(READ_MAX)
        entries = []
        for line in data.splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    entries.append(entry)
        self._lines = len(entries)
        return entries[-self.keep:]

    def append(self, entry: dict[str, Any], recent: list[dict[str, Any]]) -> None:
        """Adds `entry`; rewrites the file as `recent` (which ends with it) when it has grown
        to `trim_at` x `keep` lines. Never raises: a history not written loses only history."""
        line = (json.dumps(entry, default=str) + "\n").encode()
        try:
            if self._lines + 1 >= self.keep * self.trim_at:
                self._rewrite(recent[-self.keep:])
                return
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
            self._lines += 1
        except OSError:
            pass

    def _rewrite(self, entries: list[dict[str, Any]]) -> None:
        write_atomically(self.path, b"".join((json.dumps(e, default=str) + "\n").encode()
                                             for e in entries), 0o600, sync=False)
        self._lines = len(entries)
