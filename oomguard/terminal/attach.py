"""The attach client: relays the user's terminal and a job's pty holder (raw mode; Ctrl-\\
detaches, as in dtach), for `oomguard attach`, `oomguard exec` and `oomguard restore`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import socket
import struct
import termios
import tty
from collections.abc import Callable, Iterator
from typing import Any

DETACH_KEY = b"\x1c"  # Ctrl-\
FRAME = struct.Struct(">cI")
ENDED, DETACHED, HANGUP = "ended", "detached", "hangup"


def frame(kind: bytes, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def window_size(fd: int) -> tuple[int, int] | None:
    try:
        rows, cols, _, _ = struct.unpack(
            "HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    return rows, cols


def winsize_frame(rows: int, cols: int) -> bytes:
    return frame(b"w", struct.pack(">HH", rows, cols))


@contextlib.contextmanager
def raw_terminal(fd: int | None) -> Iterator[None]:
    """The user's terminal in raw mode (keys, Ctrl-C included, go to the job), put back after."""
    if fd is None or not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, termios.error):  # the terminal may be gone (hangup)
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def signal_wakeups(signals: tuple[int, ...]) -> Iterator[int]:
    """A fd that gets one byte (the signal number) per signal caught while inside."""
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)
    old = {sig: signal.signal(sig, lambda *_: None) for sig in signals}
    old_fd = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    try:
        yield rfd
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        os.close(rfd)
        os.close(wfd)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


class Relay:
    """One attached session: `run` returns why it stopped (ENDED: the holder closed, the job is
    over; DETACHED: the user pressed Ctrl-\\; HANGUP: the user's terminal is gone; or what
    `on_signal` returned)."""

    def __init__(self, sock: socket.socket, stdin_fd: int | None, stdout_fd: int,
                 wake_fd: int, on_signal: Callable[[int], str | None] | None = None) -> None:
        self.sock = sock
        self.stdin_fd = stdin_fd
        self.stdout_fd = stdout_fd
        self.wake_fd = wake_fd
        self.on_signal = on_signal or (lambda _sig: None)

    def send_window_size(self) -> None:
        size = window_size(self.stdin_fd if self.stdin_fd is not None else self.stdout_fd)
        if size is not None:
            with contextlib.suppress(OSError):
                self.sock.sendall(winsize_frame(*size))

    def run(self) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "holder")
        sel.register(self.wake_fd, selectors.EVENT_READ, "wake")
        if self.stdin_fd is not None:
            sel.register(self.stdin_fd, selectors.EVENT_READ, "stdin")
        self.send_window_size()
        with sel:
            while True:
                for key, _ in sel.select():
                    why = self._step(key.data)
                    if why is not None:
                        return why

    def _step(self, source: Any) -> str | None:
        if source == "holder":
            return self.output()
        if source == "stdin":
            assert self.stdin_fd is not None
            try:
                data = os.read(self.stdin_fd, 4096)
            except OSError:
                data = b""
            if not data:
                return HANGUP
            if DETACH_KEY in data:
                data = data[:data.index(DETACH_KEY)]
                if data:
                    self.sock.sendall(frame(b"d", data))
                return DETACHED
            try:
                self.sock.sendall(frame(b"d", data))
            except OSError:
                return ENDED
            return None
        for sig in os.read(self.wake_fd, 64):
            if sig == signal.SIGWINCH:
                self.send_window_size()
                continue
            why = self.on_signal(sig)
            if why is not None:
                return why
        return None

    def output(self) -> str | None:
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            return ENDED
        try:
            _write_all(self.stdout_fd, data)
        except OSError:
            return HANGUP
        return None

    def drain(self) -> None:
        """Pass on everything the holder still sends, until it closes."""
        while self.output() is None:
            pass
