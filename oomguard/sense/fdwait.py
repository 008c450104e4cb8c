"""Waiting for a file descriptor to become readable, whatever its number.

select.select() refuses descriptors numbered FD_SETSIZE (1024) or more, and a daemon guarding
a thousand cgroups holds more than that (an eventfd and a control file per v1 guard): with it,
CRIU's post-dump action never got its answer and every checkpoint waited out the gate's timeout.
poll(2) has no such limit.
"""

from __future__ import annotations

import select
from typing import Protocol


class HasFileno(Protocol):
    def fileno(self) -> int: ...


def wait_readable(fd: int | HasFileno, timeout: float | None) -> bool:
    """True once `fd` is readable (or hung up: a read then says what happened), False if
    `timeout` seconds passed first; None waits without end."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    millis = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return bool(poller.poll(millis))
