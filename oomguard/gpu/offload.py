"""The GPU steps around a CRIU dump and restore, with their undo: CUDA state is moved into the
process's host memory before the dump (cuda-checkpoint), after checking that the cgroup and the
machine can hold it, and moved back to the GPU after a restore, or after a dump that failed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from oomguard.cgroup.base import MemoryCgroup
from oomguard.gpu.budget import host_budget
from oomguard.gpu.cudackpt import CudaCheckpointError
from oomguard.gpu.runtime import ENGINE_NONE, GpuSupport
from oomguard.model.errors import CgroupGone, OomguardError
from oomguard.model.units import format_size
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import ProcessInfo


class GpuRefused(OomguardError):
    """A GPU process cannot be checkpointed now; it was not touched and keeps its GPU."""


@dataclass
class GpuHold:
    """CUDA state moved off the GPU for a dump: which pids (host), and how to undo."""

    pids: list[int]
    ns_pids: list[int]  # the same in the tree's own PID namespace (recorded in the checkpoint)
    vram_bytes: int
    suspended: bool = False
    undo_limit: Callable[[], None] | None = field(default=None, repr=False)


def _ns_pid(proc: ProcessInfo) -> int:
    return proc.nspid[-1] if proc.nspid else proc.pid


def move_off_gpu(gpu: GpuSupport, tree: ProcessTree, cgroup: MemoryCgroup | None, *,
                 margin: int, mem_available: Callable[[], int],
                 lift: Callable[[MemoryCgroup, int], Callable[[], None]],
                 thaw: Callable[[list[int]], None]) -> GpuHold | None:
    """None if the tree holds no GPU memory. With CRIU's CUDA plugin as the engine, only
    notes the pids (CRIU moves the state). Raises GpuRefused, having undone what it did."""
    vram = gpu.vram_by_pid()
    pids = gpu.gpu_pids(tree.pids, vram)
    if not pids:
        return None
    members = {p.pid: p for p in tree.members}
    total = sum(vram[pid] for pid in pids)
    hold = GpuHold(pids=pids, ns_pids=[_ns_pid(members[pid]) for pid in pids], vram_bytes=total)
    if gpu.engine == ENGINE_NONE:
        raise GpuRefused(f"pid(s) {', '.join(map(str, pids))} hold {format_size(total)} of GPU "
                         f"memory and CUDA state cannot be checkpointed here ({gpu.why})")
    if not gpu.drives_cuda:
        return hold
    usage, limit = 0, None
    if cgroup is not None:
        try:
            snap = cgroup.snapshot()
            usage, limit = snap.usage_bytes, snap.limit_bytes
        except CgroupGone:
            pass
    budget = host_budget(tree.rss_bytes, total, usage, limit, mem_available(), margin)
    if not budget.ok:
        raise GpuRefused(f"not enough host memory to take the CUDA state of "
                         f"pid(s) {', '.join(map(str, pids))} off the GPU: {budget.reason}")
    if budget.raise_limit_to is not None and cgroup is not None:
        hold.undo_limit = lift(cgroup, budget.raise_limit_to)
    thaw(list(tree.pids))  # cuda-checkpoint needs the process running (a freeze step stops it)
    try:
        gpu.suspend(pids)
    except CudaCheckpointError as exc:
        put_back_limit(hold)
        raise GpuRefused(f"CUDA state could not be moved off the GPU; the process keeps running "
                         f"on it: {exc}") from exc
    hold.suspended = True
    return hold


def put_back_limit(hold: GpuHold) -> None:
    if hold.undo_limit is not None:
        with contextlib.suppress(OSError, CgroupGone):
            hold.undo_limit()
        hold.undo_limit = None


def back_to_gpu(gpu: GpuSupport, pids: Sequence[int]) -> str | None:
    """CUDA state back onto the GPU; None, or what went wrong (the process runs on, locked)."""
    try:
        gpu.resume(pids)
    except CudaCheckpointError as exc:
        return str(exc)
    return None


def restored_host_pids(ns_pids: Sequence[int], restored: Sequence[ProcessInfo],
                       pidns: bool) -> list[int]:
    """The host pids of restored GPU processes: the same pids (CRIU restores them), or, for a
    tree in its own PID namespace, those whose innermost pid matches."""
    if not pidns:
        return list(ns_pids)
    by_inner = {_ns_pid(p): p.pid for p in restored}
    return [by_inner[pid] for pid in ns_pids if pid in by_inner]
