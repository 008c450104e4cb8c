"""The self-pipe: how one thread (or a signal handler) wakes another asleep in poll/select.

One pipe, both ends non-blocking and close-on-exec. A wake-up writes a byte (a full pipe has
one pending already, and a closed one has nobody to wake: neither is an error); the sleeper
polls the read end and drains it when it is ready. For signals, Python's
signal.set_wakeup_fd(pipe.write_fd) writes each caught signal's number to it.

At the bottom of the import graph (only ``os``): every layer may use it.
"""

from __future__ import annotations

import contextlib
import os


class WakePipe:
    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        """The end to poll."""
        return self.read_fd

    def wake(self, why: bytes = b"w") -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending) or closed
            os.write(self.write_fd, why)

    def drain(self) -> bytes:
        """What the wake-ups wrote (at most 64 bytes at a time: the poll says ready again
        while more is left); b"" when nothing was."""
        try:
            return os.read(self.read_fd, 64)
        except OSError:  # nothing to read (or closed)
            return b""

    def close(self) -> None:
        """Both ends; once (a second close never reaches a reused fd)."""
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self.write_fd = -1
