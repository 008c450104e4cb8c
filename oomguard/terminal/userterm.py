"""The user's terminal, for the attach client (oomguard/terminal/attach.py): its size, raw
mode, whether we are its foreground job and could stop as one, signals as bytes on a fd, and
lines typed into it that we do not read (they grow its input queue)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import termios
import tty
from collections.abc import Iterator

from oomguard.model.wakepipe import WakePipe


def window_size(fd: int) -> tuple[int, int] | None:
    try:
        rows, cols, _, _ = struct.unpack(
            "HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    return rows, cols


@contextlib.contextmanager
def raw_terminal(fd: int | None) -> Iterator[None]:
    """The user's terminal in raw mode (keys, Ctrl-C included, go to the job), put back after."""
    if fd is None or not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, termios.error):  # the terminal may be gone (hangup)
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def signal_wakeups(signals: tuple[int, ...]) -> Iterator[int]:
    """A fd that gets one byte (the signal number) per signal caught while inside."""
    wakeups = WakePipe()
    old = {sig: signal.signal(sig, lambda *_: None) for sig in signals}
    old_fd = signal.set_wakeup_fd(wakeups.write_fd, warn_on_full_buffer=False)
    try:
        yield wakeups.fileno()
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        wakeups.close()


def write_all(fd: int, data: bytes) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def in_foreground(fd: int | None) -> bool:
    """Whether we are the foreground job of our terminal (a shell's `bg` job is not)."""
    if fd is None:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def pending_input(fd: int) -> int:
    """Bytes waiting in a terminal's input queue (in canonical mode: whole lines)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])
    except OSError:
        return 0


class TypedLines:
    """Tells when the user types a new line on a terminal we do not read: its input queue
    grows past what was there already (lines typed or pasted before the job started are the
    shell's, unless the job reads them). Edge-triggered, so waiting lines wake us once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.seen = pending_input(fd)
        self.asked = False  # the holder was asked to give the job its terminal
        self.poll = select.epoll()
        self.poll.register(fd, select.EPOLLIN | select.EPOLLET)

    def fileno(self) -> int:
        return self.poll.fileno()

    def new_line(self) -> bool:
        self.poll.poll(0)
        now = pending_input(self.fd)
        grew = now > self.seen
        self.seen = now
        return grew

    def close(self) -> None:
        self.poll.close()


def can_suspend(fd: int) -> bool:
    """Whether stopping ourselves hands the terminal to a shell that can continue us: we are
    its foreground job, in a process group that is not orphaned (the kernel ignores SIGTSTP
    there)."""
    if not in_foreground(fd):
        return False
    try:
        parent = os.getppid()
        return os.getsid(parent) == os.getsid(0) and os.getpgid(parent) != os.getpgrp()
    except OSError:
        return False


