"""`oomguard restore --wait`: ask again until the checkpoint fits into its cgroup (the daemon
or the direct check refuses it with NoRoom until then), or until --timeout."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from oomguard.control.client import ControlError
from oomguard.control.protocol import ERROR_NO_ROOM
from oomguard.model.errors import NeverFits, NoRoom, RestoreFailed

RETRY_INTERVAL = 2.0  # seconds between two asks while it does not fit


def no_room(exc: Exception) -> bool:
    """A refusal for lack of room now (direct: NoRoom; through the daemon: its error name)."""
    if isinstance(exc, NeverFits):  # larger than the cgroup could ever hold
        return False
    return isinstance(exc, NoRoom) or (isinstance(exc, ControlError) and exc.name == ERROR_NO_ROOM)


def restore_when_it_fits(attempt: Callable[[], dict[str, Any]], *, wait: bool,
                         timeout: float | None, tell: Callable[[str], None],
                         clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep,
                         interval: float = RETRY_INTERVAL) -> dict[str, Any]:
    """Run `attempt` (one Restore call, on a fresh connection: the daemon may restart
    meanwhile); with `wait`, run it again every `interval` while it is refused for lack of
    room, telling the reason once. Raises what the last attempt raised, or RestoreFailed once
    `timeout` seconds have passed. Ctrl-C (KeyboardInterrupt) ends the wait."""
    start = clock()
    told = False
    while True:
        try:
            return attempt()
        except (NoRoom, ControlError) as exc:
            if not wait or not no_room(exc):
                raise
            if timeout is not None and clock() - start >= timeout:
                raise RestoreFailed(f"gave up after waiting {timeout:g}s: {exc}") from exc
            if not told:
                limit = f", at most {timeout:g}s" if timeout is not None else ""
                tell(f"{exc}\nwaiting until it fits (Ctrl-C to give up{limit})")
                told = True
            try:
                sleep(interval)
            except KeyboardInterrupt:
                tell("gave up waiting; the checkpoint is untouched")
                raise
