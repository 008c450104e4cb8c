"""Arming cgroup guards, many at once: at start, on reload, and as cgroups appear.

On v1 each usage threshold registered through cgroup.event_control waits for an RCU grace
period in the kernel (about 12 ms here), one after another for one cgroup but independently
for different cgroups: a thousand cgroups with three marks each took 30 s one at a time and
take under a second from a pool of threads. Every cgroup's threshold mark and OOM
notification come first (from then on it is armed); the marks beyond the threshold follow.
The settings oomguard replaces (v1 oom_kill_disable, v2 memory.high) are saved in one durable
write before any of them is changed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from oomguard.cgroup import watch
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.daemon.guards import CgroupGuard
from oomguard.model.errors import CgroupGone
from oomguard.store.ledger import SavedLimits

ARM_WORKERS = 64  # concurrent registrations: past this the kernel's grace periods dominate

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Prepared:
    """What arming found and did for one guard (read by the loop, which registers the fds)."""

    guard: CgroupGuard
    snapshot: MemorySnapshot | None = None  # None: the cgroup is gone
    setting_now: int | None = None  # v1 oom_kill_disable, v2 memory.high, as found
    change_setting: bool = False  # oomguard replaces it (its original is saved first)
    error: str | None = None  # the kernel's notifications could not be armed: polled
    later_error: str | None = None  # the marks beyond the threshold could not be added

    @property
    def saved_key(self) -> str:
        return watch.saved_key(self.guard)


class Armer:
    """Arms guards from a pool of threads (inline for one). `own_snapshot` reads a cgroup with
    its own limit (never one oomguard lifted for a dump)."""

    def __init__(self, own_snapshot: Callable[[MemoryCgroup], MemorySnapshot],
                 saved: SavedLimits, psi_trigger: str, *, dry_run: bool = False,
                 workers: int = ARM_WORKERS) -> None:
        self.own_snapshot = own_snapshot
        self.saved = saved
        self.psi_trigger = psi_trigger
        self.dry_run = dry_run
        self.workers = workers

    def arm(self, guards: Iterable[CgroupGuard]) -> list[Prepared]:
        """Arm every guard (their fds empty: the loop disarmed them); returns one Prepared
        each, in order. Raises nothing for a cgroup: its Prepared says what went wrong."""
        prepared = self._map(self._read, list(guards))
        changing = [p for p in prepared if p.change_setting]
        originals = self.saved.remember_many({p.saved_key: p.setting_now for p in changing})
        armed = [p for p in prepared if p.snapshot is not None and p.snapshot.limit_bytes]
        self._two_phases(armed, lambda p: self._first(p, originals.get(p.saved_key)),
                         self._later)
        return prepared

    # -- the phases (each runs in a worker thread, one guard at a time) ------------------------

    def _read(self, guard: CgroupGuard) -> Prepared:
        found = Prepared(guard)
        try:
            found.snapshot = snap = self.own_snapshot(guard.cgroup)
            if snap.limit_bytes is None or not guard.spec.events:
                return found
            setting = watch.read_setting(guard, snap.limit_bytes, self.dry_run)
            found.setting_now, found.change_setting = setting.now, setting.change
        except CgroupGone:
            found.snapshot = None
        except OSError as exc:
            found.error = str(exc)
        return found

    def _first(self, found: Prepared, original: int | None) -> bool:
        """The threshold mark, the OOM notification and the replaced setting; False when the
        guard could not be armed (it is polled)."""
        guard, snap = found.guard, found.snapshot
        if found.error is not None or snap is None or snap.limit_bytes is None \
                or not guard.spec.events:
            return False
        try:
            return watch.arm_first(guard, snap.limit_bytes, found.change_setting, original,
                                   self.psi_trigger)
        except (OSError, CgroupGone) as exc:
            found.error = str(exc)
            return False

    def _later(self, found: Prepared) -> None:
        assert found.snapshot is not None and found.snapshot.limit_bytes is not None
        try:
            watch.arm_later(found.guard, found.snapshot.limit_bytes)
        except (OSError, CgroupGone) as exc:
            found.later_error = str(exc)

    # -- the pool ------------------------------------------------------------------------------

    def _map(self, work: Callable[[T], R], items: list[T]) -> list[R]:
        results: list[R | None] = [None] * len(items)

        def one(index: int) -> None:
            results[index] = work(items[index])

        self._run_all(one, list(range(len(items))))
        return [r for r in results if r is not None]

    def _two_phases(self, items: list[Prepared], first: Callable[[Prepared], bool],
                    later: Callable[[Prepared], None]) -> None:
        """`first` for every item, then `later` for those whose first said so: every
        threshold mark is in before any later mark."""
        needs_later: list[Prepared] = []
        lock = threading.Lock()

        def one(item: Prepared) -> None:
            if first(item):
                with lock:
                    needs_later.append(item)

        self._run_all(one, items)
        self._run_all(later, needs_later)

    def _run_all(self, work: Callable[[T], None], items: list[T]) -> None:
        """`work` on every item from up to `workers` threads, each taking the next item until
        none is left (no future per item: a thousand of them would stay in the heap)."""
        if len(items) <= 1 or self.workers <= 1:
            for item in items:
                work(item)
            return
        queue = iter(items)
        lock = threading.Lock()
        failures: list[BaseException] = []

        def worker() -> None:
            while True:
                with lock:
                    try:
                        item = next(queue)
                    except StopIteration:
                        return
                try:
                    work(item)
                except BaseException as exc:  # a bug, not a cgroup's error: raised below
                    failures.append(exc)
                    return

        threads = [threading.Thread(target=worker, name="oomguard-arm", daemon=True)
                   for _ in range(min(self.workers, len(items)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
