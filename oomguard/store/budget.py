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
                 on_pruned: Callable[[list[Prune]], None],
                 planned: list[Prune] | None = None) -> None:
        self._budget, self._token, self._on_pruned = budget, token, on_pruned
        self.need = need
        self.planned = planned or []  # restored checkpoints to prune once the tree has stopped

    def prune_planned(self) -> None:
        """Prune what the reservation counted on (restored checkpoints, chosen when it was
        made): once the tree has stopped, off the way from a crossing to its SIGSTOP (removing
        a few checkpoints of 100-200 MiB took 250-400 ms there under load). Outside the
        budget's lock: other dumps' reservations never wait for it. One that could not be
        pruned (being restored meanwhile) is made up for as grow() does, or BudgetExceeded."""
        planned, self.planned = self.planned, []
        if not planned:
            return
        done = [p for p in planned if self._budget._forget(p.id)]
        with self._budget._lock:
            for prune in planned:
                self._budget._doomed.pop(prune.id, None)
            if done:
                self._on_pruned(done)
            if len(done) < len(planned):
                self._budget._claim(self._token, self.need, self._on_pruned)

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
        self._doomed: dict[str, int] = {}  # planned prunes not yet done: id -> bytes
        self._tokens = itertools.count()
        self._usage = UsageCache()
        self._lock_usage = threading.Lock()  # status and doctor read beside a dump's reserve

    @contextlib.contextmanager
    def reserve(self, need: int,
                on_pruned: Callable[[list[Prune]], None] = lambda pruned: None, *,
                deferred: bool = False) -> Iterator[Reservation]:
        """Room for a new checkpoint of about `need` bytes beside the dumps under way (their
        estimates, held until each ends), restored checkpoints pruned to make it (told to
        `on_pruned`). Raises BudgetExceeded where there is none even so. The Reservation may
        grow later (the tree measured once it has stopped). `deferred`: the prunes are only
        chosen now (counted as done, and never chosen by another reservation), and made by
        Reservation.prune_planned(); those of a reservation that ends first are not made."""
        planned: list[Prune] = []
        with self._lock:
            token = next(self._tokens)
            if deferred:
                planned = self._plan(token, need)
            else:
                self._claim(token, need, on_pruned)
        room = Reservation(self, token, need, on_pruned, planned)
        try:
            yield room
        finally:
            with self._lock:
                self._reserved.pop(token, None)
                for prune in room.planned:  # not made: the checkpoints stay
                    self._doomed.pop(prune.id, None)

    def _plan(self, token: int, need: int) -> list[Prune]:
        """Under self._lock: `need` bytes for `token`, counting on restored checkpoints to be
        pruned later (returned; nothing is deleted here)."""
        pending = sum(v for k, v in self._reserved.items() if k != token)
        reading = self.reading()
        soon = sum(self._doomed.values())  # other reservations' planned prunes
        planned: list[Prune] = []
        if not reading.fits(max(0, need + pending - soon)):
            items = [Stored(m.id, m.created, m.state, m.image_bytes)
                     for m in self.store.list() if m.id not in self._doomed]
            planned = choose_prunes(items, self.wall_clock(),
                                    reading.excess(max(0, need + pending - soon)), None)
        freed = soon + sum(p.size for p in planned)
        if not reading.fits(max(0, need + pending - freed)):
            raise BudgetExceeded(reading.refusal(need),
                                 {**reading.fields(), "need": need, "pending": pending})
        self._doomed.update({p.id: p.size for p in planned})
        self._reserved[token] = need
        return planned

    def _claim(self, token: int, need: int,
               on_pruned: Callable[[list[Prune]], None]) -> None:
        """Under self._lock: `need` bytes for `token`, beside the other dumps' reservations."""
        pending = sum(v for k, v in self._reserved.items() if k != token)
        # Other reservations' planned prunes count as made (and are not chosen again here).
        pending -= sum(self._doomed.values())
        reading, pruned = self.make_room(max(0, need + pending), aged=False,
                                         keep=frozenset(self._doomed))
        if pruned:
            on_pruned(pruned)
        if not reading.fits(max(0, need + pending)):
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

    def make_room(self, need: int = 0, *, aged: bool = True,
                  keep: frozenset[str] = frozenset()) -> tuple[BudgetReading, list[Prune]]:
        """Prune what the rules allow (restored past max_age; restored, oldest first, while
        `need` more bytes do not fit: read again after each round, as an image's size is not
        quite what it takes on disk). Returns the reading after, and what was pruned.
        `aged` False (a dump's reservation, on its way to the victim's SIGSTOP): nothing is
        listed or pruned where `need` fits (the keeper prunes by age every minute). `keep`:
        checkpoints not to prune here (a reservation's planned prunes)."""
        reading = self.reading()
        pruned: list[Prune] = []
        if not aged and reading.fits(need):
            return reading, pruned  # nothing to prune for this need (age: the keeper's)
        while True:
            gone = {p.id for p in pruned} | keep
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
