"""A gate between oomguard and its CRIU action script (oomguard/store/criu_hook.py): two FIFOs in a
root-only checkpoint directory, BASE.req (the script's requests) and BASE.ack (oomguard's
replies), both held open by oomguard for reading and writing. While oomguard lives, the script's
requests find a reader and a reply it waits for stays in the FIFO until read; once oomguard is
gone, the script's open fails (ENXIO) or its wait reads a hang-up: it never blocks on a dead
peer."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from types import TracebackType

from oomguard.sense.fdwait import wait_readable
from oomguard.store.criu_hook import REPLY_SUFFIX, REQUEST_SUFFIX

_OPEN = os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW


def gate_paths(base: Path) -> tuple[Path, Path]:
    return base.with_name(base.name + REQUEST_SUFFIX), base.with_name(base.name + REPLY_SUFFIX)


def remove_gates(directory: Path) -> None:
    """FIFOs a gate left behind (its oomguard died): never followed, only FIFOs removed."""
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            if entry.name.endswith((REQUEST_SUFFIX, REPLY_SUFFIX)):
                with contextlib.suppress(OSError):
                    if stat.S_ISFIFO(entry.lstat().st_mode):
                        entry.unlink()


class Gate:
    """Raises OSError if the FIFOs cannot be made."""

    def __init__(self, directory: Path, name: str) -> None:
        self.base = directory / name
        self.request_path, self.reply_path = gate_paths(self.base)
        self._fds: list[int] = []
        self._pending = b""
        try:
            for path in (self.request_path, self.reply_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # a leftover, or anything planted there: never followed
                os.mkfifo(path, 0o600)
                self._fds.append(os.open(path, _OPEN))
        except OSError:
            self.close()
            raise

    @property
    def request_fd(self) -> int:
        return self._fds[0]

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def request(self, timeout: float) -> str | None:
        """The next request line, waiting up to `timeout` seconds; None if none came."""
        while b"\n" not in self._pending:
            if not wait_readable(self.request_fd, max(timeout, 0.0)):
                return None
            try:
                chunk = os.read(self.request_fd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode(errors="replace")

    def reply(self, text: str) -> None:
        """One reply line (at most a few hundred bytes: it fits the FIFO's buffer, so this
        never blocks, whether or not the script reads it)."""
        os.write(self._fds[1], text.replace("\n", " ")[:512].encode() + b"\n")

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        for path in (self.request_path, self.reply_path):
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(path.lstat().st_mode):
                    path.unlink()
