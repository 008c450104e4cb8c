"""sd_notify(3) in plain Python: tell the service manager we are ready, alive, or stopping.

The protocol (sd_notify(3), systemd's NOTIFY_SOCKET documentation): newline-separated
VARIABLE=value assignments in one datagram, sent over an AF_UNIX SOCK_DGRAM socket to the
address in $NOTIFY_SOCKET -- a filesystem path, or an abstract socket when it starts with '@'
(which stands for the leading NUL). Without $NOTIFY_SOCKET (not started by systemd, or
Type= is not notify) every call is a no-op.

Sending never raises: the service manager may be gone (ECONNREFUSED, ENOENT) or congested
(a timeout), and a daemon must not die for that. Failures are counted in `send_errors`, and
the last one is kept in `last_error` for the caller to log.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping

# How long one datagram may block when the manager's receive queue is full.
DEFAULT_SEND_TIMEOUT = 1.0


def _dgram_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)


def socket_address(notify_socket: str) -> str | None:
    """The AF_UNIX address for a $NOTIFY_SOCKET value: '@name' -> '\\0name' (abstract), an
    absolute path as is. None for anything else (empty, relative, or a form this module does
    not speak, such as systemd's 'vsock:CID:PORT')."""
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        return "\0" + notify_socket[1:]
    if notify_socket.startswith("/"):
        return notify_socket
    return None


def _positive_int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not (text.isascii() and text.isdigit()):  # rejects '', signs, '1e6', '0x10', '²'
        return None
    value = int(text)
    return value if value > 0 else None


def _one_line(text: str) -> str:
    """A value may not carry a newline (it would start another assignment) nor a NUL (the
    manager drops datagrams holding one)."""
    return text.replace("\0", "").replace("\r", " ").replace("\n", " ")


class Notifier:
    """Sends sd_notify datagrams to `address` (an AF_UNIX address as Python takes it: a path,
    or '\\0name' for an abstract socket); None makes every method a no-op.

    `watchdog_usec` and `watchdog_pid` are $WATCHDOG_USEC and $WATCHDOG_PID, already parsed;
    `watchdog_interval()` turns them into how often to call `watchdog()`.
    """

    def __init__(self, address: str | None = None, *, watchdog_usec: int | None = None,
                 watchdog_pid: int | None = None,
                 socket_factory: Callable[[], socket.socket] = _dgram_socket,
                 getpid: Callable[[], int] = os.getpid,
                 send_timeout: float = DEFAULT_SEND_TIMEOUT) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self.watchdog_pid = watchdog_pid
        self.send_timeout = send_timeout
        self.send_errors = 0
        self.last_error: OSError | None = None
        self._socket_factory = socket_factory
        self._getpid = getpid
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ,
                 socket_factory: Callable[[], socket.socket] = _dgram_socket,
                 getpid: Callable[[], int] = os.getpid,
                 send_timeout: float = DEFAULT_SEND_TIMEOUT) -> Notifier:
        """A Notifier for $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID in `environ`.
        An unusable $NOTIFY_SOCKET gives a no-op Notifier (see `socket_address`); a
        $WATCHDOG_PID that is not a pid turns the watchdog off."""
        address = socket_address(environ.get("NOTIFY_SOCKET", ""))
        usec = _positive_int(environ.get("WATCHDOG_USEC"))
        raw_pid = environ.get("WATCHDOG_PID")
        pid = _positive_int(raw_pid)
        if raw_pid is not None and pid is None:
            usec = None
        return cls(address, watchdog_usec=usec, watchdog_pid=pid, socket_factory=socket_factory,
                   getpid=getpid, send_timeout=send_timeout)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, message: str) -> bool:
        """Send one raw datagram ('A=1\\nB=2'). True if it was sent; False when disabled or
        when sending failed (counted in `send_errors`, kept in `last_error`)."""
        if self.address is None:
            return False
        try:
            with self._socket_factory() as sock:
                sock.settimeout(self.send_timeout)
                sock.sendto(message.encode("utf-8", "surrogateescape"), self.address)
        except OSError as exc:  # ECONNREFUSED, ENOENT, EAGAIN/timeout, EMFILE, ...
            with self._lock:
                self.send_errors += 1
                self.last_error = exc
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between `watchdog()` calls: half of $WATCHDOG_USEC, as
        sd_watchdog_enabled(3) advises. None when no watchdog is asked for, when notifying is
        off, or when $WATCHDOG_PID names another process."""
        if self.address is None or self.watchdog_usec is None:
            return None
        if self.watchdog_pid is not None and self.watchdog_pid != self._getpid():
            return None
        return self.watchdog_usec / 2 / 1_000_000
