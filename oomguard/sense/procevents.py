"""Process events from the kernel's connector (cn_proc): fork, exec and exit of every process
on the machine, as they happen, on a NETLINK_CONNECTOR socket, encoded and decoded by pyroute2
(its cn_proc messages and marshal).

Who may listen: since Linux 6.6 any user (before it, CAP_NET_ADMIN), in the initial network,
PID and user namespaces, on a kernel with CONFIG_PROC_EVENTS. Elsewhere opening raises OSError:
ECONNREFUSED in another network namespace (the connector lives in the initial one), EPERM
without the capability on older kernels, and ETIMEDOUT when the kernel ignores the request
(another PID or user namespace, or no CONFIG_PROC_EVENTS: it sends no answer). `unavailable()`
puts the reason in words.

The messages are encoded and decoded in cnproc.py (pyroute2, loaded lazily).

The descriptor is read directly: pyroute2 keeps its socket, event loop and queue per thread
(threading.local) and its get() waits for a message, while the exit watch subscribes in one
thread and reads in another, and a freeze must read exactly what is queued, at once. So
ProcEvents makes and reads the socket itself, and pyroute2 encodes and decodes the messages.
"""


from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from oomguard.sense.cnproc import (
    CN_IDX_PROC,
    NETLINK_CONNECTOR,
    PROC_CN_MCAST_IGNORE,
    PROC_CN_MCAST_LISTEN,
    SOCKET_BUFFER,
    ControlAck,
    ProcessEvent,
    control_message,
    load_cn_proc,
    parse_messages,
)
from oomguard.sense.fdwait import wait_readable

ACK_TIMEOUT = 0.25  # the kernel answers within the send (measured: 25 us); none means ignored
RECV_SIZE = 4096  # one event per datagram (76 bytes)
MAX_DATAGRAMS = 8192  # per read(): a storm of events cannot hold the reader forever
LASTING = frozenset({errno.EPERM, errno.EACCES, errno.ECONNREFUSED, errno.EPROTONOSUPPORT,
                     errno.EAFNOSUPPORT, errno.ETIMEDOUT, errno.ENOENT, errno.ENOPKG})

@dataclass(frozen=True)
class EventBatch:
    """What one read() found, in the kernel's order. `lost`: how many times the socket's
    buffer overflowed since the last read (ENOBUFS): events are missing in between."""

    events: tuple[ProcessEvent, ...] = ()
    lost: int = 0


class EventSource(Protocol):
    """A subscribed stream of process events (ProcEvents, or a test's fake)."""

    def fileno(self) -> int: ...

    def read(self) -> EventBatch: ...

    def close(self) -> None: ...


def connector_socket() -> socket.socket:
    """A non-blocking NETLINK_CONNECTOR socket bound to the process events' multicast group.
    Made here rather than by pyroute2's ProcEventSocket: that one builds an asyncio event
    loop per socket (~1.3 ms, on the path from a crossing to SIGSTOP), and its bind() tries
    ports 20-199 and turns EPERM into KeyError('no free address'). pyroute2 still encodes
    and decodes every message, so it is loaded (or found missing) here first."""
    try:
        load_cn_proc()
    except ImportError as exc:  # an environment made before the dependency: fall back
        raise OSError(errno.ENOPKG, f"pyroute2 is not installed ({exc})") from exc
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                         NETLINK_CONNECTOR)
    try:
        sock.setblocking(False)
        # The buffers pyroute2 gives its sockets (the kernel caps them at rmem/wmem_max).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        sock.bind((0, CN_IDX_PROC))
    except OSError:
        sock.close()
        raise
    return sock


class ProcEvents:
    """A subscription to the kernel's process events. Opening subscribes and waits for the
    kernel's answer; raises OSError where the connector is unavailable (see the module
    docstring). read() returns every event queued now, without blocking; close() sends
    IGNORE (the kernel stops sending once nobody listens)."""

    def __init__(self, *, kinds: frozenset[int] | None = None,
                 open_socket: Callable[[], socket.socket] = connector_socket,
                 ack_timeout: float = ACK_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kinds = kinds  # the events read() returns (None: fork, exec and exit)
        self.sock = open_socket()
        self._ack = random.getrandbits(31)
        self._early: list[ProcessEvent] = []  # events that came before the answer
        self._lost = 0
        try:
            self.sock.send(control_message(PROC_CN_MCAST_LISTEN, self._ack))
            self._await_ack(ack_timeout, clock)
        except OSError:
            self.sock.close()
            raise
        # Dropped unclosed (an exception between a freeze and its wait): IGNORE all the same,
        # or the kernel keeps counting a listener and formatting every event for nobody.
        self._close = weakref.finalize(self, _unsubscribe, self.sock, self._ack)

    def _await_ack(self, timeout: float, clock: Callable[[], float]) -> None:
        deadline = clock() + timeout
        while True:
            for message in self._receive():
                if isinstance(message, ControlAck):
                    if message.ack == (self._ack + 1) & 0xFFFFFFFF:
                        if message.err:
                            raise OSError(message.err, os.strerror(message.err))
                        return
                else:
                    self._early.append(message)
            left = deadline - clock()
            if left <= 0:
                raise OSError(errno.ETIMEDOUT, "the process-event connector did not answer")
            wait_readable(self.sock, left)

    def _receive(self) -> list[ProcessEvent | ControlAck]:
        found: list[ProcessEvent | ControlAck] = []
        for _ in range(MAX_DATAGRAMS):
            try:
                data = self.sock.recv(RECV_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                self._lost += 1  # the queue overflowed; what is queued after it still reads
                continue
            found.extend(parse_messages(data, self.kinds))
        return found

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> EventBatch:
        """Every event queued now (up to MAX_DATAGRAMS), oldest first. A socket that fails
        otherwise (closed meanwhile) counts as events lost, for the caller to fall back."""
        try:
            received = self._receive()
        except OSError:
            received = []
            self._lost += 1
        events = self._early + [m for m in received if not isinstance(m, ControlAck)]
        self._early = []
        lost, self._lost = self._lost, 0
        return EventBatch(tuple(events), lost)

    def close(self) -> None:
        self._close()


def _unsubscribe(sock: socket.socket, ack: int) -> None:
    with contextlib.suppress(OSError):
        sock.send(control_message(PROC_CN_MCAST_IGNORE, ack))
    sock.close()


# -- availability, in words -------------------------------------------------------------------

_WHY = {
    errno.EPERM: "no CAP_NET_ADMIN",
    errno.EACCES: "no CAP_NET_ADMIN",
    errno.ECONNREFUSED: "not in the initial network namespace (a container?)",
    errno.EPROTONOSUPPORT: "the kernel has no connector (CONFIG_CONNECTOR) here",
    errno.EAFNOSUPPORT: "no netlink sockets here",
    errno.ETIMEDOUT: "no answer: not in the initial PID and user namespaces, or a kernel "
                     "without CONFIG_PROC_EVENTS",
    errno.EMFILE: "too many open files",
    errno.ENOPKG: "pyroute2 is not installed (pip install pyroute2)",
}


def unavailable(exc: OSError) -> str:
    """Why the connector could not be opened, e.g. 'EPERM: no CAP_NET_ADMIN'."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    return f"{name}: {_WHY.get(code) or exc.strerror or str(exc)}"


class Subscriber:
    """Opens subscriptions on demand (the freezer's, one per freeze) and remembers a lasting
    reason it cannot (a namespace, a capability, the kernel): not tried again, so a freeze
    where the kernel never answers does not wait ACK_TIMEOUT each time."""

    def __init__(self, open_events: Callable[[], EventSource] | None = None, *,
                 kinds: frozenset[int] | None = None) -> None:
        self.open_events = open_events or (lambda: ProcEvents(kinds=kinds))
        self.why_not: str | None = None  # set once a lasting reason is known
        self.last_error: str | None = None  # the latest failure, lasting or not
        self._lock = threading.Lock()

    def open(self) -> EventSource | None:
        """A new subscription, or None (then `why_not`, or `last_error`, says why)."""
        if self.why_not is not None:
            return None
        try:
            return self.open_events()
        except OSError as exc:
            with self._lock:
                self.last_error = unavailable(exc)
                if exc.errno in LASTING:
                    self.why_not = self.last_error
            return None

    def probe(self) -> str | None:
        """Open and close one subscription (loads pyroute2 now rather than at the first
        freeze); None if it works, else why not."""
        events = self.open()
        if events is None:
            return self.why_not or self.last_error
        events.close()
        return None


def process_events_words(why_not: str | None) -> str:
    """One line on how forks and exits are seen (doctor, guard.started)."""
    if why_not is None:
        return "kernel connector (fork/exit seen at once)"
    return f"unavailable ({why_not}): freeze re-lists /proc"
