"""Desktop notifications over D-Bus when a user's process is checkpointed or restored.

Two halves, joined by a broadcast signal on the system bus:

* `SignalEmitter` (in the root daemon) emits ``io.oomguard.Guard1.Checkpointed`` and
  ``io.oomguard.Guard1.Restored`` from the object ``/io/oomguard/Guard``. The body is
  ``usss``: (uid of the process owner, checkpoint id, command line, one-line message).
  Emitting never raises for bus trouble: an unreachable bus makes it return False, keeps the
  error in `last_error`, and is retried at most once per `retry_interval` seconds.
* `NotificationAgent` (oomguard/observe/notifyagent.py: one per desktop user, as a systemd user
  service) subscribes to those signals on the system bus, keeps the ones for its own uid that
  come from a trusted sender (uid 0 by default: anyone may send a signal on the system bus),
  and turns each into an ``org.freedesktop.Notifications.Notify`` call on the user's session
  bus.

This module holds the emitter and what both halves share (names, messages, connections).

Pure Python D-Bus through jeepney's blocking I/O (jeepney ships no type information, hence
the ``type: ignore`` on its imports). Bus addresses are what jeepney takes: ``"SYSTEM"``,
``"SESSION"``, or a full address such as ``"unix:path=/run/dbus/system_bus_socket"``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jeepney import (  # type: ignore[import-untyped]
    DBusAddress,
    new_signal,
)
from jeepney.bus import get_bus  # type: ignore[import-untyped]
from jeepney.io.blocking import DBusConnection, prep_socket  # type: ignore[import-untyped]

from oomguard.model.errors import OomguardError
from oomguard.observe import rendering

OBJECT_PATH = "/io/oomguard/Guard"
INTERFACE = "io.oomguard.Guard1"
SIGNAL_CHECKPOINTED = "Checkpointed"
SIGNAL_RESTORED = "Restored"
SIGNALS = (SIGNAL_CHECKPOINTED, SIGNAL_RESTORED)
# (uid of the process owner, checkpoint id, command line, one-line human message)
SIGNAL_SIGNATURE = "usss"

NOTIFICATIONS_NAME = "org.freedesktop.Notifications"
NOTIFICATIONS_PATH = "/org/freedesktop/Notifications"
NOTIFICATIONS_INTERFACE = "org.freedesktop.Notifications"
# Notify(app_name, replaces_id, app_icon, summary, body, actions, hints, expire_timeout)
NOTIFY_SIGNATURE = "susssasa{sv}i"
APP_NAME = "oomguard"
SUMMARIES = {
    SIGNAL_CHECKPOINTED: "Checkpointed to save memory",
    SIGNAL_RESTORED: "Restored",
}

DEFAULT_RETRY_INTERVAL = 60.0  # seconds between attempts to reach an unreachable bus
DEFAULT_IO_TIMEOUT = 5.0  # seconds for connecting, sending, and waiting for a reply
DEFAULT_POLL_INTERVAL = 1.0  # how often NotificationAgent.run looks at its stop event
TRUSTED_SENDER_UIDS: frozenset[int] = frozenset({0})
COMMAND_MAX_CHARS = 200  # of the command line quoted in a message
_UINT32_MAX = 2**32 - 1

# A jeepney blocking DBusConnection (jeepney is untyped, so this is Any to mypy).
Connection = Any
ConnectionFactory = Callable[[str], Connection]


class DBusCallError(OomguardError):
    """A D-Bus method call got an error reply; `name` is the D-Bus error name."""

    def __init__(self, name: str, detail: str = "") -> None:
        self.name = name
        super().__init__(f"{name}: {detail}" if detail else name)


class _BoundedConnection(DBusConnection):  # type: ignore[misc]
    """jeepney's blocking connection, with a default reply timeout. jeepney's own constructor
    waits for the bus's answer to Hello with no time limit, so a bus that accepts the socket
    and then never answers would hang the caller (the daemon, mid-checkpoint) forever."""

    def __init__(self, sock: socket.socket, reply_timeout: float) -> None:
        self.reply_timeout = reply_timeout
        super().__init__(sock)

    def send_and_get_reply(self, message: Any, *, timeout: float | None = None,
                           **kwargs: Any) -> Any:
        return super().send_and_get_reply(
            message, timeout=self.reply_timeout if timeout is None else timeout, **kwargs)


def open_connection(address: str, timeout: float = DEFAULT_IO_TIMEOUT) -> Connection:
    """A jeepney blocking connection to `address` ('SYSTEM', 'SESSION' or a full address).
    Authentication, the Hello exchange, every send, and every reply waited for without an
    explicit timeout take at most `timeout` seconds each: a wedged bus makes a call fail
    instead of hanging the caller. Raises what jeepney raises: OSError (TimeoutError for a
    silent bus) for a missing, refusing or wedged socket, KeyError without
    $DBUS_SESSION_BUS_ADDRESS, RuntimeError or ValueError for an address it cannot use."""
    sock = prep_socket(get_bus(address), timeout=timeout)
    try:
        sock.settimeout(timeout)
        return _BoundedConnection(sock, timeout)
    except BaseException:
        sock.close()
        raise


def _dbus_text(text: str) -> str:
    """`text` as a valid D-Bus string: UTF-8 without NUL. Command lines read from /proc may
    hold undecodable bytes (surrogate escapes) and NUL separators."""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\0", " ")


def _one_line(text: str, limit: int = COMMAND_MAX_CHARS) -> str:
    """`text` on one line (control characters become spaces, runs of blanks collapse), cut
    to `limit` characters with an ellipsis."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in _dbus_text(text))
    line = " ".join(cleaned.split())
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def _describe(command: str, pid: int) -> str:
    line = _one_line(command)
    return f"{line} (pid {pid})" if line else f"process {pid}"


def restore_command(checkpoint_id: str) -> str:
    """The command a user runs to bring `checkpoint_id` back (the one `show` and the CLI's
    checkpoint.done give), on one line."""
    return rendering.restore_command(_one_line(checkpoint_id))


def checkpointed_message(checkpoint_id: str, command: str, pid: int) -> str:
    """'python3 train.py (pid 4242) was checkpointed to save memory; bring it back with:
    oomguard restore <id>'"""
    return (f"{_describe(command, pid)} was checkpointed to save memory; "
            f"bring it back with: {restore_command(checkpoint_id)}")


def restored_message(checkpoint_id: str, command: str, pid: int) -> str:
    """'python3 train.py (pid 4242) was restored from checkpoint <id>'"""
    return f"{_describe(command, pid)} was restored from checkpoint {_one_line(checkpoint_id)}"


def _check_uid(uid: int) -> None:
    if not 0 <= uid <= _UINT32_MAX:
        raise ValueError(f"uid {uid} is not a uint32")


def close_quietly(conn: Connection) -> None:
    with contextlib.suppress(Exception):  # a broken connection must not mask the first error
        conn.close()


class SignalEmitter:
    """Emits Checkpointed/Restored on the bus at `address`, connecting on first use.

    The emit methods return True when the signal was handed to the bus and False when the bus
    could not be reached or the send failed; they never raise for that. The error is kept in
    `last_error`, and `send_errors` counts failed connection attempts and sends. While the bus
    stays unreachable a new connection is attempted at most once per `retry_interval` seconds
    (by `clock`), and emits in between return False at once. A connection found broken (the
    bus restarted) is replaced right away, once; if that fails, the retry interval applies.
    Thread-safe.
    """

    def __init__(self, address: str = "SYSTEM", *,
                 connect: ConnectionFactory = open_connection,
                 clock: Callable[[], float] = time.monotonic,
                 retry_interval: float = DEFAULT_RETRY_INTERVAL) -> None:
        self.address = address
        self.retry_interval = retry_interval
        self.last_error: Exception | None = None
        self.send_errors = 0
        self._connect = connect
        self._clock = clock
        self._conn: Connection | None = None
        self._next_attempt: float | None = None
        self._emitter = DBusAddress(OBJECT_PATH, interface=INTERFACE)
        self._lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def emit_checkpointed(self, uid: int, checkpoint_id: str, command: str, pid: int) -> bool:
        """Tell `uid` that `command` (pid `pid`) was checkpointed as `checkpoint_id`.
        Raises ValueError only for a uid that is not a uint32 (a caller bug)."""
        return self._emit(SIGNAL_CHECKPOINTED, uid, checkpoint_id, command,
                          checkpointed_message(checkpoint_id, command, pid))

    def emit_restored(self, uid: int, checkpoint_id: str, command: str, pid: int) -> bool:
        """Tell `uid` that `command` (now pid `pid`) was restored from `checkpoint_id`.
        Raises ValueError only for a uid that is not a uint32 (a caller bug)."""
        return self._emit(SIGNAL_RESTORED, uid, checkpoint_id, command,
                          restored_message(checkpoint_id, command, pid))

    def close(self) -> None:
        """Drop the connection. A later emit connects again (without waiting for the retry
        interval)."""
        with self._lock:
            if self._conn is not None:
                close_quietly(self._conn)
            self._conn = None
            self._next_attempt = None

    def __enter__(self) -> SignalEmitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _emit(self, member: str, uid: int, checkpoint_id: str, command: str, message: str) -> bool:
        _check_uid(uid)
        signal = new_signal(self._emitter, member, SIGNAL_SIGNATURE,
                            (uid, _dbus_text(checkpoint_id), _dbus_text(command), message))
        with self._lock:
            # Two tries: a connection that turns out to be dead (the bus restarted since the
            # last emit) is replaced at once; `_connection` applies the retry interval.
            for _ in range(2):
                conn = self._connection()
                if conn is None:
                    return False
                try:
                    self._drain(conn)
                    conn.send(signal)
                except Exception as exc:  # OSError, TimeoutError, ... : the bus, not us
                    self._record(exc)
                    close_quietly(conn)
                    self._conn = None
                    continue
                return True
            return False

    def _connection(self) -> Connection | None:
        if self._conn is not None:
            return self._conn
        now = self._clock()
        if self._next_attempt is not None and now < self._next_attempt:
            return None
        self._next_attempt = now + self.retry_interval
        try:
            self._conn = self._connect(self.address)
        except Exception as exc:  # missing socket, refused, auth timeout, bad address, ...
            self._record(exc)
            return None
        self._next_attempt = None
        return self._conn

    def _record(self, exc: Exception) -> None:
        self.last_error = exc
        self.send_errors += 1

    @staticmethod
    def _drain(conn: Connection) -> None:
        """Read and drop what the bus sent us (NameAcquired, ...), so nothing piles up; a
        connection the bus has closed shows here as ConnectionResetError."""
        while True:
            try:
                conn.receive(timeout=0)
            except TimeoutError:
                return
