"""Which checkpoints the store deletes, and why: a pure function of the catalogue and the time.

Only restored checkpoints are ever deleted (their process runs again; the images are a spare
copy): those past max_age go anyway; when the store is over its budget (oomguard.policy.budget:
its cap, or the file system's keep_free), restored ones go oldest first until the excess is
freed. A checkpoint that has not been restored is NEVER deleted, whatever the budget says: it
is all there is of its process (a new checkpoint is refused instead). One being written
("dumping") is never chosen either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STATE_RESTORED = "restored"


@dataclass(frozen=True)
class Stored:
    id: str
    created: float
    state: str  # checkpointed | restored | dumping | incomplete
    size: int


@dataclass(frozen=True)
class Prune:
    id: str
    size: int
    reason: str


def choose_prunes(items: Iterable[Stored], now: float, excess: int,
                  max_age: float | None) -> list[Prune]:
    """`excess`: bytes the budget wants freed (0: within it). Returns the restored
    checkpoints to delete, in order: past max_age first, then the oldest, only as many as
    the excess needs. What is left over budget stays: unrestored checkpoints are kept."""
    restored = sorted((i for i in items if i.state == STATE_RESTORED), key=lambda i: i.created)
    prunes = [Prune(i.id, i.size, "restored and older than max_age") for i in restored
              if max_age is not None and now - i.created > max_age]
    freed = sum(p.size for p in prunes)
    chosen = {p.id for p in prunes}
    for item in restored:
        if freed >= excess:
            break
        if item.id not in chosen:
            prunes.append(Prune(item.id, item.size, "restored; the store is over its budget"))
            freed += item.size
    return prunes
