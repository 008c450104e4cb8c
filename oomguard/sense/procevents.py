"""Process events from the kernel's connector (cn_proc): fork, exec and exit of every process
on the machine, as they happen, on a NETLINK_CONNECTOR socket, encoded and decoded by pyroute2
(its cn_proc messages and marshal).

Who may listen: since Linux 6.6 any user (before it, CAP_NET_ADMIN), in the initial network,
PID and user namespaces, on a kernel with CONFIG_PROC_EVENTS. Elsewhere opening raises OSError:
ECONNREFUSED in another network namespace (the connector lives in the initial one), EPERM
without the capability on older kernels, and ETIMEDOUT when the kernel ignores the request
(another PID or user namespace, or no CONFIG_PROC_EVENTS: it sends no answer). `unavailable()`
puts the reason in words.

pyroute2 is imported lazily, at the first subscription, and without running its package
`__init__`, which imports every netlink family (IPRoute, NDB, conntrack, ...): measured
beside `import oomguard.rundaemon`, +9.8 MiB RSS and 95 ms, against +1.1 MiB and 14 ms for
the connector's own modules (the daemon stays within 40 MiB guarding 1000 cgroups).

The descriptor is read directly: pyroute2 keeps its socket, event loop and queue per thread
(threading.local) and its get() waits for a message, while the exit watch subscribes in one
thread and reads in another, and a freeze must read exactly what is queued, at once. So
ProcEvents makes and reads the socket itself, and pyroute2 encodes and decodes the messages.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import os
import random
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

CN_PROC_MODULE = "pyroute2.netlink.connector.cn_proc"
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0  # the kernel's answer to LISTEN/IGNORE (an ack carrying an errno)
PROC_EVENT_FORK = 0x1
PROC_EVENT_EXEC = 0x2
PROC_EVENT_EXIT = 0x80000000
FORKS = frozenset({PROC_EVENT_FORK})  # what the freeze reads
EXITS = frozenset({PROC_EVENT_EXIT})  # what the exit watch reads
NLMSG_DONE = 3
NLMSG_HEADER = 16  # struct nlmsghdr
CN_ACK_OFFSET = NLMSG_HEADER + 12  # struct cn_msg: id {idx, val}, seq, ack
NETLINK_CONNECTOR = 11  # linux/netlink.h
SOCKET_BUFFER = 1 << 20  # SO_RCVBUF/SO_SNDBUF, as pyroute2's NetlinkSocket sets them
EVENT_OFFSET = NLMSG_HEADER + 20  # + struct cn_msg: where struct proc_event begins
EVENT_MIN = EVENT_OFFSET + 16  # what, cpu, timestamp_ns
ACK_TIMEOUT = 0.25  # the kernel answers within the send (measured: 25 us); none means ignored
RECV_SIZE = 4096  # one event per datagram (76 bytes)
MAX_DATAGRAMS = 8192  # per read(): a storm of events cannot hold the reader forever
LASTING = frozenset({errno.EPERM, errno.EACCES, errno.ECONNREFUSED, errno.EPROTONOSUPPORT,
                     errno.EAFNOSUPPORT, errno.ETIMEDOUT, errno.ENOENT, errno.ENOPKG})

_import_lock = threading.Lock()
_CONTROL: dict[int, bytes] = {}  # LISTEN and IGNORE as pyroute2 encodes them, ack 0


@dataclass(frozen=True)
class ProcessFork:
    parent_pid: int  # the thread that forked (the child's real parent: CLONE_PARENT names
    parent_tgid: int  # the grandparent here)
    child_pid: int
    child_tgid: int
    timestamp_ns: int = 0  # CLOCK_MONOTONIC (time.monotonic_ns)

    @property
    def new_process(self) -> bool:
        """A process, not a thread of the parent's."""
        return self.child_pid == self.child_tgid


@dataclass(frozen=True)
class ProcessExec:
    pid: int
    tgid: int
    timestamp_ns: int = 0


@dataclass(frozen=True)
class ProcessExit:
    pid: int  # the thread that exited
    tgid: int  # its process
    wait_status: int  # as waitpid(2) would report it: code << 8, or the signal
    timestamp_ns: int = 0  # CLOCK_MONOTONIC (time.monotonic_ns) of the exit

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.wait_status) if os.WIFEXITED(self.wait_status) else None

    @property
    def signal(self) -> int | None:
        return self.wait_status & 0x7F if os.WIFSIGNALED(self.wait_status) else None


@dataclass(frozen=True)
class ControlAck:
    """The kernel's answer to a LISTEN or IGNORE: our `ack` + 1, and an errno (0: done)."""

    ack: int
    err: int


ProcessEvent = ProcessFork | ProcessExec | ProcessExit


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


# -- pyroute2, loaded at first use ----------------------------------------------------------

def load_cn_proc(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> ModuleType:
    """pyroute2's cn_proc module. Where pyroute2 is not imported yet, its package is put in
    sys.modules without running its `__init__` (see the module docstring), then the connector
    modules are imported; if that fails for any reason, the plain `import pyroute2`."""
    loaded = sys.modules.get(CN_PROC_MODULE)
    if loaded is not None:
        return loaded
    with _import_lock:
        if "pyroute2" not in sys.modules:
            try:
                spec = find_spec("pyroute2")
                if spec is None or spec.loader is None:
                    raise ImportError("pyroute2 not found")
                sys.modules["pyroute2"] = importlib.util.module_from_spec(spec)
                return importlib.import_module(CN_PROC_MODULE)
            except Exception:  # any failure: undo it, and import the package whole
                for name in [n for n in sys.modules if n == "pyroute2" or
                             n.startswith("pyroute2.")]:
                    del sys.modules[name]
        importlib.import_module("pyroute2")
        return importlib.import_module(CN_PROC_MODULE)


_MARSHAL: dict[str, Any] = {}  # filled at first use


def _marshal() -> Any:
    """pyroute2's ProcEventMarshal, also decoding the ack's errno (its base class stops at
    the timestamp)."""
    cached = _MARSHAL.get("marshal")
    if cached is None:
        cn_proc = load_cn_proc()

        base = cn_proc.proc_event_base
        proc_event_ack = type("proc_event_ack", (base,), {"fields": (*base.fields, ("err", "I"))})
        marshal = cn_proc.ProcEventMarshal()  # its msg_map is the instance's own copy
        marshal.msg_map[PROC_EVENT_NONE] = proc_event_ack
        cached = _MARSHAL.setdefault("marshal", marshal)
    return cached


def control_message(op: int, ack: int) -> bytes:
    """LISTEN or IGNORE as pyroute2 encodes it: nlmsghdr, cn_msg {idx 1, val 1, ack}, op.
    Encoded by pyroute2 once per op (~0.2 ms); the ack, random per subscription, is put in
    its place in a copy (cn_msg's fourth field)."""
    template = _CONTROL.get(op)
    if template is None:
        msg = load_cn_proc().proc_event_control()
        msg["header"]["type"] = NLMSG_DONE
        msg["header"]["flags"] = 0
        msg["header"]["sequence_number"] = 0
        msg["header"]["pid"] = 0
        msg["idx"], msg["val"], msg["seq"], msg["ack"] = CN_IDX_PROC, CN_VAL_PROC, 0, 0
        msg["len"] = 4
        msg["action"] = op
        msg.encode()
        template = _CONTROL.setdefault(op, bytes(msg.data))
    message = bytearray(template)
    struct.pack_into("=I", message, CN_ACK_OFFSET, ack & 0xFFFFFFFF)
    return bytes(message)


def _convert(msg: Any) -> ProcessEvent | ControlAck | None:
    what = msg["what"]
    stamp = msg["timestamp_ns"]
    if what == PROC_EVENT_FORK:
        return ProcessFork(msg["parent_pid"], msg["parent_tgid"], msg["child_pid"],
                           msg["child_tgid"], stamp)
    if what == PROC_EVENT_EXEC:
        return ProcessExec(msg["process_pid"], msg["process_tgid"], stamp)
    if what == PROC_EVENT_EXIT:
        return ProcessExit(msg["process_pid"], msg["process_tgid"], msg["exit_code"], stamp)
    if what == PROC_EVENT_NONE:
        return ControlAck(msg["ack"], msg["err"])
    return None  # uid, gid, sid, ptrace, comm, coredump: not used


def parse_messages(datagram: bytes, kinds: frozenset[int] | None = None,
                   ) -> list[ProcessEvent | ControlAck]:
    """The fork, exec and exit events (only those of `kinds`, if given) and the acks in one
    datagram, decoded by pyroute2's marshal one netlink message at a time (its parse() trusts
    lengths: a truncated or oversized message is skipped here, not read past). Other kinds are
    skipped on their `what` field alone: a busy machine sends thousands of events a second
    and the marshal costs ~12 us each (2 loaded cores)."""
    found: list[ProcessEvent | ControlAck] = []
    offset = 0
    marshal = _marshal()
    while offset + NLMSG_HEADER <= len(datagram):
        length = struct.unpack_from("=I", datagram, offset)[0]
        if length < NLMSG_HEADER or offset + length > len(datagram):
            break
        what = struct.unpack_from("=I", datagram, offset + EVENT_OFFSET)[0] \
            if length >= EVENT_MIN else None
        if what is not None and (kinds is None or what in kinds or what == PROC_EVENT_NONE):
            with contextlib.suppress(Exception):  # a malformed event is skipped
                for msg in marshal.parse(datagram[offset:offset + length]):
                    if msg["header"].get("error") is None:
                        event = _convert(msg)
                        if event is not None:
                            found.append(event)
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return found


def parse_events(datagram: bytes, kinds: frozenset[int] | None = None) -> list[ProcessEvent]:
    return [e for e in parse_messages(datagram, kinds) if not isinstance(e, ControlAck)]


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
            select.select([self.sock], [], [], left)

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
