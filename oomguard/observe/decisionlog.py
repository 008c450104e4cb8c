"""When a decision is worth a log line: a dry run at a lasting low-memory condition decides
the same thing at every poll (ten times a second), and says it once, then again only when the
decision changes (another victim, another action) or once a minute."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

REPEAT_EVERY = 60.0  # seconds: an unchanged decision is said again this often


@dataclass
class _Said:
    decision: Hashable
    at: float
    quiet: int = 0  # the same decision since, not logged


class DecisionLog:
    """Per key (a rule and what it decided about: its crossing, its victim), the last decision
    logged. Called from the guard loop and the action threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 every: float = REPEAT_EVERY) -> None:
        self.clock = clock
        self.every = every
        self._said: dict[tuple[str, str], _Said] = {}
        self._lock = threading.Lock()

    def due(self, rule: str, about: str, decision: Hashable) -> int | None:
        """None: stay quiet (the same as last logged, under `every` seconds ago). Otherwise
        log it, and the number returned is how many times it was decided unsaid since."""
        now = self.clock()
        with self._lock:
            said = self._said.get((rule, about))
            if said is not None and said.decision == decision and now - said.at < self.every:
                said.quiet += 1
                return None
            quiet = said.quiet if said is not None and said.decision == decision else 0
            self._said[(rule, about)] = _Said(decision, now)
            return quiet

    def forget(self, rule: str) -> None:
        """The rule's condition is over: whatever it decides next is news."""
        with self._lock:
            for key in [k for k in self._said if k[0] == rule]:
                del self._said[key]
