"""The desktop half of oomguard's D-Bus notifications: `NotificationAgent`, one per desktop
user (a systemd user service), turns the daemon's Checkpointed/Restored signals for its uid,
sent by a trusted sender, into desktop notifications (see oomguard/observe/dbus.py)."""

from __future__ import annotations

import html
import os
import threading
from collections import deque
from collections.abc import Collection
from typing import Any

from jeepney import (  # type: ignore[import-untyped]
    DBusAddress,
    HeaderFields,
    MatchRule,
    MessageType,
    message_bus,
    new_method_call,
)

from oomguard.model.errors import OomguardError
from oomguard.observe.dbus import (
    APP_NAME,
    DEFAULT_IO_TIMEOUT,
    DEFAULT_POLL_INTERVAL,
    INTERFACE,
    NOTIFICATIONS_INTERFACE,
    NOTIFICATIONS_NAME,
    NOTIFICATIONS_PATH,
    NOTIFY_SIGNATURE,
    OBJECT_PATH,
    SIGNAL_SIGNATURE,
    SIGNALS,
    SUMMARIES,
    TRUSTED_SENDER_UIDS,
    Connection,
    ConnectionFactory,
    DBusCallError,
    close_quietly,
    open_connection,
)


class NotificationError(OomguardError):
    """The desktop notification could not be shown (session bus or notification server)."""


class NotificationAgent:
    """Turns Checkpointed/Restored signals for `uid` into desktop notifications.

    Listens on `system_address` and notifies on `session_address`. Only signals sent by a
    connection whose uid is in `trusted_sender_uids` count (None trusts every sender); on a
    real system bus anyone may broadcast a signal, and a notification telling a user to run a
    command must not be forgeable by other users. Connections are opened lazily; `close()`
    drops them.
    """

    def __init__(self, system_address: str = "SYSTEM", session_address: str = "SESSION", *,
                 uid: int | None = None,
                 trusted_sender_uids: Collection[int] | None = TRUSTED_SENDER_UIDS,
                 connect: ConnectionFactory = open_connection,
                 timeout: float = DEFAULT_IO_TIMEOUT,
                 poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        self.system_address = system_address
        self.session_address = session_address
        self.uid = os.getuid() if uid is None else uid
        self.trusted_sender_uids = (None if trusted_sender_uids is None
                                    else frozenset(trusted_sender_uids))
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.notified = 0
        self._connect = connect
        self._system: Connection | None = None
        self._session: Connection | None = None
        self._markup: bool | None = None  # does the notification server take body markup?
        self._queue: deque[Any] = deque(maxlen=256)
        self._filter: Any = None
        self._sender_uids: dict[str, int | None] = {}
        self._rule = MatchRule(type="signal", interface=INTERFACE, path=OBJECT_PATH)
        self._notifications = DBusAddress(NOTIFICATIONS_PATH, bus_name=NOTIFICATIONS_NAME,
                                          interface=NOTIFICATIONS_INTERFACE)

    def subscribe(self) -> None:
        """Connect to the system bus and ask it for our signals (AddMatch). Idempotent; `run`
        calls it. Signals emitted after this returns are queued for `run`. Raises what the
        connection or the AddMatch call raises."""
        if self._filter is not None:
            return
        conn = self._system_connection()
        self._call(conn, message_bus.AddMatch(self._rule))
        self._filter = conn.filter(self._rule, queue=self._queue)

    def run(self, stop: threading.Event | None = None, max_events: int | None = None) -> int:
        """Receive signals until `stop` is set or `max_events` signals for this user have been
        handled (notified), and return how many were. Raises on the loss of the system bus
        (the service manager restarts the agent) and NotificationError when a notification
        cannot be shown."""
        self.subscribe()
        conn = self._system_connection()
        handled = 0
        while (stop is None or not stop.is_set()) and (max_events is None or handled < max_events):
            if self._queue:
                msg = self._queue.popleft()
            else:
                try:
                    msg = conn.recv_until_filtered(self._queue, timeout=self.poll_interval)
                except TimeoutError:
                    continue
            if self.handle(msg):
                handled += 1
        return handled

    def handle(self, msg: Any) -> bool:
        """Show the notification for one received message. True when it was one of our signals
        for this user from a trusted sender and the notification was shown; False when it is
        ignored (another uid, an untrusted sender, another signal, a malformed body). Raises
        NotificationError when the notification could not be shown."""
        parsed = self._parse(msg)
        if parsed is None:
            return False
        member, message = parsed
        if not self._trusted(msg.header.fields.get(HeaderFields.sender)):
            return False
        self.notify(SUMMARIES[member], message)
        return True

    def notify(self, summary: str, body: str) -> int:
        """Show one notification on the session bus and return its id."""
        try:
            conn = self._session_connection()
            if self._markup is None:
                self._markup = self._server_takes_markup(conn)
            text = html.escape(body, quote=False) if self._markup else body
            reply = self._call(conn, new_method_call(
                self._notifications, "Notify", NOTIFY_SIGNATURE,
                (APP_NAME, 0, "", summary, text, [], {}, -1)))
        except DBusCallError as exc:  # the server answered, with an error: keep the connection
            raise NotificationError(f"cannot show notification: {exc}") from exc
        except Exception as exc:  # I/O trouble: reconnect for the next notification
            self._drop_session()
            raise NotificationError(f"cannot show notification: {exc}") from exc
        self.notified += 1
        return int(reply[0])

    def close(self) -> None:
        if self._filter is not None:
            self._filter.close()
            self._filter = None
        for conn in (self._system, self._session):
            if conn is not None:
                close_quietly(conn)
        self._system = self._session = None
        self._markup = None
        self._sender_uids.clear()
        self._queue.clear()

    def __enter__(self) -> NotificationAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self, msg: Any) -> tuple[str, str] | None:
        """(member, message) of a Checkpointed/Restored signal for this uid, else None."""
        fields = msg.header.fields
        if (msg.header.message_type != MessageType.signal
                or fields.get(HeaderFields.interface) != INTERFACE
                or fields.get(HeaderFields.path) != OBJECT_PATH
                or fields.get(HeaderFields.member) not in SIGNALS
                or fields.get(HeaderFields.signature) != SIGNAL_SIGNATURE):
            return None
        uid, _checkpoint_id, _command, message = msg.body
        if uid != self.uid:
            return None
        return str(fields[HeaderFields.member]), str(message)

    def _trusted(self, sender: str | None) -> bool:
        if self.trusted_sender_uids is None:
            return True
        if not sender:
            return False
        if sender not in self._sender_uids:  # unique names are never reused on a bus
            try:
                reply = self._call(self._system_connection(),
                                   message_bus.GetConnectionUnixUser(sender))
                self._sender_uids[sender] = int(reply[0])
            except Exception:  # the sender is gone already, or the bus would not say
                self._sender_uids[sender] = None
        return self._sender_uids[sender] in self.trusted_sender_uids

    def _server_takes_markup(self, conn: Connection) -> bool:
        try:
            reply = self._call(conn, new_method_call(self._notifications, "GetCapabilities"))
        except Exception:  # not a fatal question: send plain text
            return False
        return "body-markup" in reply[0]

    def _call(self, conn: Connection, msg: Any) -> tuple[Any, ...]:
        """Send a method call and return the reply body; raise DBusCallError for an error reply
        (and jeepney's own exceptions, OSError or TimeoutError, for I/O trouble)."""
        reply = conn.send_and_get_reply(msg, timeout=self.timeout)
        if reply.header.message_type == MessageType.error:
            name = str(reply.header.fields.get(HeaderFields.error_name, "?"))
            detail = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
            raise DBusCallError(name, detail)
        return tuple(reply.body)

    def _system_connection(self) -> Connection:
        if self._system is None:
            self._system = self._connect(self.system_address)
        return self._system

    def _session_connection(self) -> Connection:
        if self._session is None:
            self._session = self._connect(self.session_address)
        return self._session

    def _drop_session(self) -> None:
        if self._session is not None:
            close_quietly(self._session)
        self._session = None
        self._markup = None
