"""Pressure stall information: PSI triggers on /proc/pressure/memory and memory.pressure
(Documentation/accounting/psi.rst); the files' numbers are parsed by oomguard.model.pressure.

A trigger is "<some|full> <stall us> <window us>" written into the pressure file and ending
with a NUL byte (the kernel overwrites the last byte). The fd then polls POLLPRI when the
stall within any window exceeds the threshold. Windows must be 500 ms..10 s; without
CAP_SYS_RESOURCE only multiples of 2 s are accepted.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

CAP_SYS_RESOURCE = 24
MIN_WINDOW_US = 500_000
UNPRIVILEGED_WINDOW_US = 2_000_000


def has_cap_sys_resource(status_text: str) -> bool:
    """From /proc/self/status: is CAP_SYS_RESOURCE in the effective set?"""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def shortest_window_us(privileged: bool) -> int:
    """The shortest trigger window this process may use."""
    return MIN_WINDOW_US if privileged else UNPRIVILEGED_WINDOW_US


def trigger_string(kind: str, stall_us: int, window_us: int) -> str:
    if kind not in ("some", "full"):
        raise ValueError(f"PSI trigger kind must be 'some' or 'full', got {kind!r}")
    if not 0 < stall_us <= window_us:
        raise ValueError(f"PSI stall {stall_us}us must be within the window {window_us}us")
    return f"{kind} {stall_us} {window_us}"


def open_trigger(path: Path, trigger: str) -> int:
    """Register `trigger` on a pressure file; returns the fd to poll (POLLPRI)."""
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.write(fd, trigger.encode() + b"\0")
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.EINVAL:
            raise ValueError(f"kernel refused PSI trigger {trigger!r} on {path}") from exc
        raise
    return fd
