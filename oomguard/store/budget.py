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
from oomguard.store.names import PARTIAL_PREFIX


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


class UsageCache:
    """The store's use on disk, read fast enough to stand between a crossing and the victim's
    SIGSTOP: a checkpoint directory's size is walked once and kept while its own mtime and
    inode stay (its images do not change once committed); a partial (a dump under way) is
    walked every time, and is covered by its reservation meanwhile."""

    def __init__(self) -> None:
        self._sizes: dict[tuple[str, int, int], int] = {}

    def used(self, root: Path) -> int:
        sizes: dict[tuple[str, int, int], int] = {}
        total = 0
        try:
            entries = list(os.scandir(root))
        except OSError:
            return 0
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            own = st.st_blocks * 512
            if not entry.is_dir(follow_symlinks=False):
                total += own
                continue
            key = (entry.name, st.st_ino, st.st_mtime_ns)
            size = None if entry.name.startswith(PARTIAL_PREFIX) else self._sizes.get(key)
            if size is None:
                size = own + disk_used(Path(entry.path))
            sizes[key] = size
            total += size
        self._sizes = sizes
        return total


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class Reservation:
    """A dump's room in the store's budget, held while it runs (StoreBudget.reserve)."""

    def __init__(self, budget: StoreBudget, token: int, need: int,
                 on_pruned: Callable[[list[Prune]], None]) -> None:
        self._budget, self._token, self._on_pruned = budget, token, on_pruned
        self.need = need

    def grow(self, need: int) -> None:
        """At least `need` bytes from now on; raises BudgetExceeded (the reservation as it
        was) where the budget has no room for them even after pruning."""
        if need <= self.need:
            return
        with self._budget._lock:
            self._budget._claim(self._token, need, self._on_pruned)
        self.need = need


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
        self._usage = UsageCache()
        self._lock_usage = threading.Lock()  # status and doctor read beside a dump's reserve

    @contextlib.contextmanager
    def reserve(self, need: int,
                on_pruned: Callable[[list[Prune]], None] = lambda pruned: None,
                ) -> Iterator[Reservation]:
        """Room for a new checkpoint of about `need` bytes beside the dumps under way (their
        estimates, held until each ends), restored checkpoints pruned to make it (told to
        `on_pruned`). Raises BudgetExceeded where there is none even so. The Reservation may
        grow later (the tree measured once it has stopped)."""
        with self._lock:
            token = next(self._tokens)
            self._claim(token, need, on_pruned)
        try:
            yield Reservation(self, token, need, on_pruned)
        finally:
            with self._lock:
                self._reserved.pop(token, None)

    def _claim(self, token: int, need: int,
               on_pruned: Callable[[list[Prune]], None]) -> None:
        """Under self._lock: `need` bytes for `token`, beside the other dumps' reservations."""
        pending = sum(v for k, v in self._reserved.items() if k != token)
        reading, pruned = self.make_room(need + pending, aged=False)
        if pruned:
            on_pruned(pruned)
        if not reading.fits(need + pending):
            raise BudgetExceeded(reading.refusal(need),
                                 {**reading.fields(), "need": need, "pending": pending})
        self._reserved[token] = need

    def reading(self) -> BudgetReading:
        """Now. Raises StoreError where the store's file system cannot be read."""
        try:
            fs = os.statvfs(_existing(self.store.root))
        except OSError as exc:
            raise StoreError(f"cannot read the file system of {self.store.root}: "
                             f"{exc.strerror}") from exc
        total = fs.f_blocks * fs.f_frsize
        with self._lock_usage:
            used = self._usage.used(self.store.root)
        return BudgetReading(used=used, cap=resolve(self.max_size, total),
                             free=fs.f_bavail * fs.f_frsize,
                             keep_free=resolve(self.keep_free, total) or 0, total=total)

    def make_room(self, need: int = 0, *,
                  aged: bool = True) -> tuple[BudgetReading, list[Prune]]:
        """Prune what the rules allow (restored past max_age; restored, oldest first, while
        `need` more bytes do not fit: read again after each round, as an image's size is not
        quite what it takes on disk). Returns the reading after, and what was pruned.
        `aged` False (a dump's reservation, on its way to the victim's SIGSTOP): nothing is
        listed or pruned where `need` fits (the keeper prunes by age every minute)."""
        reading = self.reading()
        pruned: list[Prune] = []
        if not aged and reading.fits(need):
            return reading, pruned  # nothing to prune for this need (age: the keeper's)
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
