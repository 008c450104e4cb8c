"""The store's use against its budget (oomguard.policy.budget), read from the disk, and the
pruning that makes room: restored checkpoints only, oldest first (oomguard.policy.retention).
Raises nothing but StoreError's kin; says nothing (the daemon logs what was pruned)."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from oomguard.model.errors import StoreError
from oomguard.policy.budget import BudgetReading, Limit, resolve
from oomguard.policy.retention import Prune, Stored, choose_prunes
from oomguard.store.checkpoints import Store


class BudgetExceeded(StoreError):
    """No room in the budget for a new checkpoint; `figures`: used, cap, free, keep_free,
    need (the estimate) and pending (what dumps under way were given), in bytes."""

    def __init__(self, message: str, figures: dict[str, int | None]) -> None:
        self.figures = figures
        super().__init__(message)


def disk_used(root: Path) -> int:
    """Bytes the directory tree at `root` takes on disk (allocated blocks: a sparse file
    counts what it holds), never following a symlink; 0 where there is none."""
    total = 0
    for top, dirs, files in os.walk(root, onerror=lambda _exc: None):
        for name in (*dirs, *files):
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class StoreBudget:
    """`max_size`, `keep_free`: as configured (bytes, a share of the file system, or None);
    `max_age`: restored checkpoints older than this are pruned whatever the budget."""

    def __init__(self, store: Store, max_size: Limit, keep_free: Limit,
                 max_age: float | None = None, *,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.max_size = max_size
        self.keep_free = keep_free
        self.max_age = max_age
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self._reserved: dict[int, int] = {}  # dumps under way: a token -> estimated bytes
        self._tokens = itertools.count()

    @contextlib.contextmanager
    def reserve(self, need: int,
                on_pruned: Callable[[list[Prune]], None] = lambda pruned: None,
                ) -> Iterator[None]:
        """Room for a new checkpoint of about `need` bytes beside the dumps under way (their
        estimates, held until each ends), restored checkpoints pruned to make it (told to
        `on_pruned`). Raises BudgetExceeded where there is none even so."""
        with self._lock:
            pending = sum(self._reserved.values())
            reading, pruned = self.make_room(need + pending)
            if pruned:
                on_pruned(pruned)
            if not reading.fits(need + pending):
                raise BudgetExceeded(reading.refusal(need),
                                     {**reading.fields(), "need": need, "pending": pending})
            token = next(self._tokens)
            self._reserved[token] = need
        try:
            yield
        finally:
            with self._lock:
                self._reserved.pop(token, None)

    def reading(self) -> BudgetReading:
        """Now. Raises StoreError where the store's file system cannot be read."""
        try:
            fs = os.statvfs(_existing(self.store.root))
        except OSError as exc:
            raise StoreError(f"cannot read the file system of {self.store.root}: "
                             f"{exc.strerror}") from exc
        total = fs.f_blocks * fs.f_frsize
        used = disk_used(self.store.root) if self.store.root.is_dir() else 0
        return BudgetReading(used=used, cap=resolve(self.max_size, total),
                             free=fs.f_bavail * fs.f_frsize,
                             keep_free=resolve(self.keep_free, total) or 0, total=total)

    def make_room(self, need: int = 0) -> tuple[BudgetReading, list[Prune]]:
        """Prune what the rules allow (restored past max_age; restored, oldest first, while
        `need` more bytes do not fit: read again after each round, as an image's size is not
        quite what it takes on disk). Returns the reading after, and what was pruned."""
        reading = self.reading()
        pruned: list[Prune] = []
        while True:
            gone = {p.id for p in pruned}
            items = [Stored(m.id, m.created, m.state, m.image_bytes)
                     for m in self.store.list() if m.id not in gone]
            done = [p for p in choose_prunes(items, self.wall_clock(), reading.excess(need),
                                             self.max_age) if self._forget(p.id)]
            if not done:
                return reading, pruned
            pruned += done
            reading = self.reading()
            if reading.fits(need):
                return reading, pruned

    def _forget(self, checkpoint_id: str) -> bool:
        try:
            self.store.forget(checkpoint_id)
        except StoreError:
            return False  # being restored right now, or no longer a checkpoint
        return True
