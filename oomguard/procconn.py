"""The kernel's process-event connector (cn_proc over NETLINK_CONNECTOR): exit codes of any
process, for root with CAP_NET_ADMIN in the initial namespaces. Parsers take bytes; the
socket is a thin wrapper around them."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_EXIT = 0x80000000
NLMSG_DONE = 3
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=IIII")  # pid, tgid, exit_code (a wait status), exit_signal


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


def listen_message(op: int = PROC_CN_MCAST_LISTEN, sender: int = 0) -> bytes:
    """The netlink message that starts (or with IGNORE stops) the stream of process events."""
    body = struct.pack("=I", op)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(body), 0) + body
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, sender) + cn


def parse_exits(datagram: bytes) -> list[ProcessExit]:
    """The exit events in one datagram (other events and malformed messages are skipped)."""
    found = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(datagram):
        length = _NLMSGHDR.unpack_from(datagram, offset)[0]
        if length < _NLMSGHDR.size or offset + length > len(datagram):
            break
        event = offset + _NLMSGHDR.size + _CN_MSG.size
        if event + _EVENT_HEAD.size + _EXIT.size <= offset + length:
            what, _cpu, stamp = _EVENT_HEAD.unpack_from(datagram, event)
            if what == PROC_EVENT_EXIT:
                pid, tgid, status, _sig = _EXIT.unpack_from(datagram, event + _EVENT_HEAD.size)
                found.append(ProcessExit(pid, tgid, status, stamp))
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return found


class ProcEvents:
    """A subscribed cn_proc socket. Raises OSError where the connector is unavailable (not
    root, no CAP_NET_ADMIN, a non-initial namespace, a kernel without CONFIG_PROC_EVENTS)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                                  NETLINK_CONNECTOR)
        try:
            self.sock.bind((0, CN_IDX_PROC))
            self.sock.setblocking(False)
            self.sock.send(listen_message())
        except OSError:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[ProcessExit]:
        """Every exit queued now (non-blocking)."""
        exits: list[ProcessExit] = []
        while True:
            try:
                exits += parse_exits(self.sock.recv(65536))
            except OSError:  # EAGAIN: all read; ENOBUFS: some were lost (status unknown)
                return exits

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(listen_message(PROC_CN_MCAST_IGNORE))
        self.sock.close()
