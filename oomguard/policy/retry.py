"""How long a rule waits before it acts again after an action that settled nothing (every
victim's chain ended thawed or refused: a store over its budget, CRIU failing on it...).
Without a wait, a cgroup held at its memory.high by the guard's own trigger wakes the loop
at once, and the same refusal repeats ten times a second for as long as the cause lasts."""

from __future__ import annotations

FIRST_RETRY = 2.0  # seconds after the first unsettled action
MOST_RETRY = 300.0  # never longer than this between tries


def retry_delay(unsettled: int, first: float = FIRST_RETRY, most: float = MOST_RETRY) -> float:
    """The wait after `unsettled` actions in a row settled nothing: `first`, doubled each time
    after, at most `most`; 0 when the last action settled it."""
    if unsettled <= 0:
        return 0.0
    return min(most, first * 2.0 ** min(unsettled - 1, 32))
