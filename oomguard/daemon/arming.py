"""Arming cgroup guards, many at once: at start, on reload, and as cgroups appear.

On v1 each usage threshold registered through cgroup.event_control waits for an RCU grace
period in the kernel (about 8 ms here), one after another for one cgroup but independently
for different cgroups: a thousand cgroups with three marks each took 30 s one at a time, and
their threshold marks take about half a second from a pool of threads. A guard is armed once
its threshold mark and OOM notification are in (v2: memory.high and memory.events). The
marks beyond the threshold, which only catch page cache up with resident memory, come after
every guard is armed, from a thread beside the loop (LaterMarks): at start after READY=1,
and until they are in, page cache over the threshold is polled, as when they cannot be
registered at all. The reads before arming never wait in the kernel and are made in turn: from
the pool, the interpreter lock's hand-offs cost more than the reads (0.4-0.8 s against 0.1 s
for 1000 cgroups here). The settings oomguard replaces (v1 oom_kill_disable, v2 memory.high)
are saved in one durable write before any of them is changed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from oomguard.cgroup import watch
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.daemon.guards import CgroupGuard
from oomguard.model.errors import CgroupGone
from oomguard.store.ledger import SavedLimits

ARM_WORKERS = 64  # concurrent registrations: past this the kernel's grace periods dominate

T = TypeVar("T")


@dataclass
class Prepared:
    """What arming found and did for one guard (read by the loop, which registers the fds)."""

    guard: CgroupGuard
    snapshot: MemorySnapshot | None = None  # None: the cgroup is gone
    setting_now: int | None = None  # v1 oom_kill_disable, v2 memory.high, as found
    change_setting: bool = False  # oomguard replaces it (its original is saved first)
    error: str | None = None  # the kernel's notifications could not be armed: polled
    later: bool = False  # marks beyond the threshold follow (LaterMarks)

    @property
    def saved_key(self) -> str:
        return watch.saved_key(self.guard)


@dataclass
class Marks:
    """One guard's marks beyond the threshold, registered beside the loop: the loop adds `fds`
    to the guard while it is still armed as it was then (`generation`), else closes them."""

    guard: CgroupGuard
    generation: int
    fds: list[int] = field(default_factory=list)
    error: str | None = None  # they could not be registered: page cache above is polled


class Armer:
    """Arms guards, their registrations from a pool of threads (inline for one). `own_snapshot`
    reads a cgroup with its own limit (never one oomguard lifted for a dump)."""

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
        each, in order, `later` where marks beyond the threshold are to follow
        (register_later). Raises nothing for a cgroup: its Prepared says what went wrong."""
        replaced = self.saved.items()  # settings oomguard replaced before (the originals)
        prepared = [self._read(guard, watch.saved_key(guard) in replaced) for guard in guards]
        changing = [p for p in prepared if p.change_setting]
        originals = self.saved.remember_many({p.saved_key: p.setting_now for p in changing})
        armed = [p for p in prepared if p.snapshot is not None and p.snapshot.limit_bytes]

        def first(found: Prepared) -> None:
            found.later = self._first(found, originals.get(found.saved_key))

        self._run_all(first, armed)
        return prepared

    def register_later(self, batch: list[tuple[Prepared, int]]) -> list[Marks]:
        """The marks beyond the threshold of each (armed guard, its generation then), from the
        pool; one Marks each. Raises nothing for a cgroup: its Marks says what went wrong."""
        done: list[Marks] = []
        lock = threading.Lock()

        def one(item: tuple[Prepared, int]) -> None:
            found, generation = item
            assert found.snapshot is not None and found.snapshot.limit_bytes is not None
            marks = Marks(found.guard, generation)
            try:
                marks.fds = watch.register_later(found.guard, found.snapshot.limit_bytes)
            except (OSError, CgroupGone) as exc:
                marks.error = str(exc)
            with lock:
                done.append(marks)

        self._run_all(one, batch)
        return done

    # -- one guard's parts (_read in the caller's thread, _first from the pool) ----------------

    def _read(self, guard: CgroupGuard, ours: bool = False) -> Prepared:
        found = Prepared(guard)
        try:
            found.snapshot = snap = self.own_snapshot(guard.cgroup)
            if snap.limit_bytes is None or not guard.spec.events:
                return found
            setting = watch.read_setting(guard, snap.limit_bytes, self.dry_run, ours)
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

    # -- the pool ------------------------------------------------------------------------------

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


class LaterMarks:
    """Registers the marks beyond the threshold from a thread of its own once a batch of guards
    is armed, so that arming (and READY=1 at start) never waits for them; calls `on_done` (the
    loop's wake-up) when a batch is in, and `take` hands the loop what came in."""

    def __init__(self, armer: Armer, on_done: Callable[[], None]) -> None:
        self.armer = armer
        self.on_done = on_done
        self._lock = threading.Lock()
        self._done: list[Marks] = []
        self._threads: list[threading.Thread] = []
        self._held: list[tuple[Prepared, int]] | None = None

    def hold(self) -> None:
        """Batches wait until `release` (the daemon's start: its first look at every cgroup
        before READY=1 shares the CPUs with nothing)."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        held, self._held = self._held, None
        if held:
            self._start(held)

    def start(self, armed: Iterable[Prepared]) -> None:
        """For each armed guard whose Prepared says `later` (its generation read now, in the
        loop's thread)."""
        batch = [(p, p.guard.generation) for p in armed if p.later]
        if self._held is not None:
            self._held += batch
        elif batch:
            self._start(batch)

    def _start(self, batch: list[tuple[Prepared, int]]) -> None:
        thread = threading.Thread(target=self._register, args=(batch,), name="oomguard-marks",
                                  daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _register(self, batch: list[tuple[Prepared, int]]) -> None:
        try:
            marks = self.armer.register_later(batch)
            with self._lock:
                self._done.extend(marks)
        finally:
            self.on_done()

    def waiting(self) -> bool:
        """Whether marks came in that the loop has not taken."""
        with self._lock:
            return bool(self._done)

    def take(self) -> list[Marks]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def join(self) -> None:
        """Until every batch started is in (then `take` has them all)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()
