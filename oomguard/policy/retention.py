"""Which checkpoints the store deletes, and why: a pure function of the catalogue and the time.

Order: restored checkpoints past max_age go anyway; when the store is over its size budget,
restored ones go first (oldest first), then unrestored ones past max_age, then — only because
the budget demands it — the oldest unrestored ones. A checkpoint being written ("dumping") is
never chosen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    id: str
    created: float
    state: str  # checkpointed | restored | dumping
    size: int


@dataclass(frozen=True)
class Prune:
    id: str
    size: int
    reason: str


def choose_prunes(items: Iterable[Stored], now: float, max_bytes: int | None,
                  max_age: float | None) -> list[Prune]:
    catalogue = sorted((i for i in items if i.state != "dumping"), key=lambda i: i.created)
    expired = {i.id for i in catalogue if max_age is not None and now - i.created > max_age}
    prunes: list[Prune] = []
    chosen: set[str] = set()

    def take(item: Stored, reason: str) -> None:
        prunes.append(Prune(item.id, item.size, reason))
        chosen.add(item.id)

    for item in catalogue:
        if item.state == "restored" and item.id in expired:
            take(item, "restored and older than max_age")
    if max_bytes is None:
        return prunes
    total = sum(i.size for i in catalogue) - sum(p.size for p in prunes)
    tiers = [
        ([i for i in catalogue if i.state == "restored"], "restored; store over its size budget"),
        ([i for i in catalogue if i.state != "restored" and i.id in expired],
         "older than max_age; store over its size budget"),
        ([i for i in catalogue if i.state != "restored"],
         "oldest unrestored checkpoint; the store's size budget demands it"),
    ]
    for candidates, reason in tiers:
        for item in candidates:
            if total <= max_bytes:
                return prunes
            if item.id not in chosen:
                take(item, reason)
                total -= item.size
    return prunes
