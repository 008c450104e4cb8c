"""What keeps the control socket from being turned against the daemon: a bound on concurrent
connections (per uid, in all, and a reserve only root may take), a rate of calls per uid (a
token bucket), and a throttle on logging."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_CONNECTIONS = 64  # in all: each is a thread in the daemon
MAX_PER_UID = 8  # one user cannot take every slot
ROOT_RESERVE = 8  # of MAX_CONNECTIONS, only uid 0 may take these: users never lock root out
REQUEST_DEADLINE = 10.0  # a request's bytes must all arrive within this, from its first one
IDLE_TIMEOUT = 30.0  # a client that starts no request for this long is dropped (configurable)
CALL_RATE = 20.0  # calls a second, sustained, per non-root uid (configurable); beyond: delayed
CALL_BURST = 40  # calls a uid may make at once before the rate applies
MAX_BAD_REQUESTS = 8  # malformed requests on one connection before it is closed


class ConnectionLimiter:
    """Counts open connections; `admit(uid)` says why one is refused, or None (then counted
    until `release(uid)`). Root (uid 0) has no share of its own but `reserve` of the `total`
    slots that no other uid may take."""

    def __init__(self, total: int = MAX_CONNECTIONS, per_uid: int = MAX_PER_UID,
                 reserve: int = ROOT_RESERVE) -> None:
        self.total = total
        self.per_uid = per_uid
        self.reserve = min(reserve, total)
        self._open: Counter[int] = Counter()
        self._lock = threading.Lock()

    def admit(self, uid: int) -> str | None:
        with self._lock:
            everyone = sum(self._open.values())
            if uid != 0:
                if self._open[uid] >= self.per_uid:
                    return (f"too many connections from uid {uid} ({self.per_uid} open at "
                            "most): close one and try again")
                users = everyone - self._open[0]
                if users >= self.total - self.reserve:
                    return (f"the daemon is serving {users} connections of users, their most "
                            f"({self.reserve} more are kept for root): try again later")
            if everyone >= self.total:
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


@dataclass
class CallSummary:
    """Routine calls counted per uid and method; `add` returns the counts since the last
    summary once `window` seconds have passed since it (then starts again), else None: one
    summary line a window, however many calls."""

    window: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _since: float | None = None
    _counts: Counter[tuple[int, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, uid: int, method: str) -> dict[str, Any] | None:
        now = self.clock()
        with self._lock:
            if self._since is None:
                self._since = now
            self._counts[(uid, method)] += 1
            if now - self._since < self.window:
                return None
            calls: dict[str, dict[str, int]] = {}
            for (who, name), count in sorted(self._counts.items()):
                calls.setdefault(str(who), {})[name] = count
            summary = {"window_s": round(now - self._since, 1), "calls": calls,
                       "total": sum(self._counts.values())}
            self._since, self._counts = now, Counter()
            return summary


@dataclass
class CallRate:
    """A token bucket per uid: `burst` calls at once, then `rate` a second. `delay(uid)` takes
    a call's token and says how long that call must wait for it (0.0: at once); the waits of
    calls made meanwhile queue up behind it."""

    rate: float = CALL_RATE
    burst: float = CALL_BURST
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[int, tuple[float, float]] = field(default_factory=dict)  # (tokens, at)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def delay(self, uid: int) -> float:
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(uid, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate) - 1.0
            self._buckets[uid] = (tokens, now)
            if len(self._buckets) > 4096:  # uids long since full again: forgotten
                self._forget_full(now)
        return 0.0 if tokens >= 0 else -tokens / self.rate

    def _forget_full(self, now: float) -> None:
        for uid, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self.rate >= self.burst:
                del self._buckets[uid]
