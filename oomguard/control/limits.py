"""What keeps the control socket from being turned against the daemon: a bound on concurrent
connections (per uid and in all), and a throttle on logging rejected requests."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CONNECTIONS = 64  # in all: each is a thread in the daemon
MAX_PER_UID = 8  # one user cannot take every slot
REQUEST_DEADLINE = 10.0  # a request's bytes must all arrive within this, from its first one
IDLE_TIMEOUT = 120.0  # a client that starts no request for this long is dropped
MAX_BAD_REQUESTS = 8  # malformed requests on one connection before it is closed


class ConnectionLimiter:
    """Counts open connections; `admit(uid)` says why one is refused, or None (then counted
    until `release(uid)`)."""

    def __init__(self, total: int = MAX_CONNECTIONS, per_uid: int = MAX_PER_UID) -> None:
        self.total = total
        self.per_uid = per_uid
        self._open: Counter[int] = Counter()
        self._lock = threading.Lock()

    def admit(self, uid: int) -> str | None:
        with self._lock:
            if self._open[uid] >= self.per_uid:
                return (f"too many connections from uid {uid} ({self.per_uid} open at most): "
                        "close one and try again")
            if sum(self._open.values()) >= self.total:
                return f"the daemon is serving {self.total} connections, its most: try again"
            self._open[uid] += 1
            return None

    def release(self, uid: int) -> None:
        with self._lock:
            self._open[uid] -= 1
            if self._open[uid] <= 0:
                del self._open[uid]

    def open_count(self) -> int:
        with self._lock:
            return sum(self._open.values())


@dataclass
class LogThrottle:
    """At most `burst` log lines per `window` seconds for one key (e.g. a uid's rejected
    requests); `allow` returns (log it?, how many were suppressed since the last one logged)."""

    burst: int = 10
    window: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _state: dict[object, tuple[float, int, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self, key: object) -> tuple[bool, int]:
        now = self.clock()
        with self._lock:
            start, logged, suppressed = self._state.get(key, (now, 0, 0))
            if now - start >= self.window:
                start, logged = now, 0
            if logged < self.burst:
                self._state[key] = (start, logged + 1, 0)
                return True, suppressed
            self._state[key] = (start, logged, suppressed + 1)
            return False, 0
