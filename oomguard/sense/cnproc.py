"""The kernel connector's process events on the wire (cn_proc): what a fork, exec, exit and
a control answer look like once decoded, the LISTEN/IGNORE messages, and the decoding of a
datagram, by pyroute2's cn_proc messages and marshal. pyroute2 is imported lazily, at the
first use, and without running its package `__init__`, which imports every netlink family
(IPRoute, NDB, conntrack, ...): measured beside `import oomguard.daemon.serve`, +9.8 MiB RSS and
95 ms, against +1.1 MiB and 14 ms for the connector's own modules. The subscription itself
(the socket, its reads, who may listen) is procevents.py."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

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
