"""A tree holding GPU memory, before its stop: its CUDA state moved into host memory
(oomguard.gpu.offload), the room for it lifted over the cgroup's limit through the dump's
room, and on refusal the tree untouched and out of the crash ledger."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

from oomguard.act.freezer import Freezer
from oomguard.act.frozen import USER_STOPPED_STATE
from oomguard.cgroup.base import MemoryCgroup
from oomguard.gpu.offload import GpuHold, GpuRefused, move_off_gpu
from oomguard.gpu.runtime import GpuSupport
from oomguard.lifecycle.dumproom import DumpRoom
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint, ProcessGone
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import ProcReader
from oomguard.store.ledger import FrozenLedger


def hand_off_gpu(gpu: GpuSupport, tree: ProcessTree, cgroup: MemoryCgroup | None,
                 held: Collection[int], *, margin: int, mem_available: Callable[[], int],
                 room: DumpRoom, freezer: Freezer, proc: ProcReader,
                 ledger: FrozenLedger) -> GpuHold | None:
    """None where the tree holds no GPU memory. Raises CheckpointFailed (untouched) where its
    CUDA state cannot be moved; a task the user had stopped stays stopped (`held`: stopped
    by oomguard already)."""

    def stopped_by_user(pid: int) -> bool:
        try:
            return proc.state(pid) == USER_STOPPED_STATE
        except ProcessGone:
            return False

    def thaw_ours(pids: list[int]) -> None:
        freezer.thaw([pid for pid in pids if pid in held or not stopped_by_user(pid)])

    def lift(cgroup: MemoryCgroup, new_limit: int) -> Callable[[], None]:
        release = room.lift(cgroup, new_limit)

        def put_back() -> None:
            release()  # one that cannot be put back yet stays pending: the settling's
        return put_back
    try:
        return move_off_gpu(gpu, tree, cgroup, margin=margin, mem_available=mem_available,
                            lift=lift, thaw=thaw_ours)
    except GpuRefused as exc:
        with contextlib.suppress(OSError):
            ledger.clear(list(tree.pids))
        raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping it: "
                               f"{exc}", FailedCheckpoint.UNTOUCHED) from exc
