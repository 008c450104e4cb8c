"""A checkpoint's room in the store's budget: reserved before the stop, fitted to the tree as
it stopped, and the budget's figures when a dump ran out of disk (oomguard/store/budget.py)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Collection, Iterator

from oomguard.cgroup.base import MemoryCgroup
from oomguard.model.errors import (
    CgroupGone,
    CheckpointFailed,
    FailedCheckpoint,
    ProcessGone,
    StoreError,
    StoreOverBudget,
)
from oomguard.policy.budget import BudgetReading, image_estimate
from oomguard.policy.retention import Prune
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import ProcReader
from oomguard.store.budget import BudgetExceeded, Reservation, StoreBudget

FULL_DISK = 1 << 20  # a failed dump that left less room than this on the store's disk ran out


@contextlib.contextmanager
def room_for(budget: StoreBudget | None, on_pruned: Callable[[list[Prune]], None],
             tree: ProcessTree, cgroup: MemoryCgroup | None) -> Iterator[Reservation | None]:
    """Room in the store's budget for the tree's image (its memory, what it may still grow by
    under its cgroup's limit before its stop, and CRIU's metadata and logs: see
    image_estimate), held while it is dumped; the restored checkpoints it needs pruned are
    chosen now and pruned once the tree has stopped (fit_stopped). Where only its memory now
    fits, that is reserved, and the tree is measured again once stopped. Refused, untouched,
    where not even that fits. None where there is no budget."""
    with contextlib.ExitStack() as reserved:
        room: Reservation | None = None
        try:
            if budget is not None:
                growth = room_under_limit(cgroup)
                try:
                    room = reserved.enter_context(budget.reserve(
                        image_estimate(tree.footprint, growth), on_pruned, deferred=True))
                except BudgetExceeded:
                    if growth == 0:
                        raise
                    room = reserved.enter_context(budget.reserve(
                        image_estimate(tree.footprint), on_pruned, deferred=True))
        except BudgetExceeded as exc:
            raise StoreOverBudget(f"checkpoint of {tree.root.pid} refused before stopping "
                                  f"it: {exc}", FailedCheckpoint.UNTOUCHED, exc.figures) from exc
        except StoreError as exc:
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping "
                                   f"it: {exc}", FailedCheckpoint.UNTOUCHED) from exc
        yield room  # what the dump raises goes on as it is


def fit_stopped(room: Reservation | None, tree: ProcessTree, pids: Collection[int],
                proc: ProcReader) -> None:
    """The stopped tree's image must fit the store's budget: its reservation grown to the tree
    as it stopped (it may have grown since it was chosen), and the restored checkpoints it
    counted on pruned now, not before the stop. Raises BudgetExceeded."""
    if room is None:
        return
    room.prune_planned()
    resident = 0
    for pid in pids:
        with contextlib.suppress(ProcessGone, OSError):
            resident += proc.process(pid).rss_bytes
    room.grow(image_estimate(resident + tree.vram_bytes))


def disk_full(budget: StoreBudget | None, exc: BaseException) -> BudgetReading | None:
    """The budget's figures where a failed dump ran out of room: ENOSPC said, or the store's
    file system (nearly) full now (a full disk often keeps CRIU from logging why)."""
    if budget is None:
        return None
    try:
        reading = budget.reading()
    except StoreError:
        return None
    return reading if out_of_space(exc) or reading.free < FULL_DISK else None


def out_of_space(exc: BaseException) -> bool:
    """The dump or its files ran out of room on the store's disk (ENOSPC, EDQUOT)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def room_under_limit(cgroup: MemoryCgroup | None) -> int:
    """What the cgroup's processes may still take before its limit (0: no limit, or gone)."""
    if cgroup is None:
        return 0
    try:
        limit = cgroup.limit()
        return 0 if limit is None else max(0, limit - cgroup.usage())
    except (OSError, CgroupGone):
        return 0
