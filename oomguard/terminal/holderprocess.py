"""The holder as a process (oomguard/terminal/holder.py): its options, its standard streams
let go, serving until the job is over, and the Leader a holder may run for (the job's session
leader and reaper: oomguard/terminal/leader.py). Stdlib only: the holder imports it."""

from __future__ import annotations

import os
import signal
import socket
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from oomguard.terminal.holder import Holder


class Leader(Protocol):
    """The holder as the job's session leader and reaper (oomguard/terminal/leader.py)."""

    def wake_fd(self) -> int: ...

    def reap(self, holder: Holder) -> None: ...

    def job_pgrp(self) -> int | None: ...

    def give_terminal(self, pid: int) -> None: ...

    def alive(self) -> bool: ...

    def outcome(self) -> tuple[int | None, int | None]: ...


def parse_options(argv: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """--name value pairs (--origin repeats) up to `--`; then the command after it."""
    opts: dict[str, str] = {}
    origin: list[str] = []
    rest = list(argv)
    while rest and rest[0] != "--":
        name = rest.pop(0)
        value = rest.pop(0)
        if name == "--origin":
            origin.append(value)
        else:
            opts[name] = value
    return opts, origin, rest[1:]


def detach_stdio() -> None:
    os.chdir("/")  # hold no mount busy
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)


def serve(holder: Holder, listener: socket.socket) -> None:
    path = listener.getsockname()
    try:
        holder.run()
    finally:
        holder.close(path)
