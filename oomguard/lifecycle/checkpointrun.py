"""One checkpoint as it goes: what it was asked for (CheckpointRequest), what its steps have
done so far and so what is left to undo (CheckpointRun), and what it gives back
(CheckpointResult, with its CheckpointTimings). oomguard.lifecycle.checkpoint walks it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.act.bystanders import Held
from oomguard.act.freezer import Frozen
from oomguard.cgroup.base import MemoryCgroup
from oomguard.gpu.offload import GpuHold
from oomguard.policy.victims import ProcessTree
from oomguard.store.checkpoints import CheckpointMeta
from oomguard.terminal.checkpointing import DumpTerminals


@dataclass(frozen=True)
class CheckpointTimings:
    freeze_s: float
    dump_s: float
    commit_s: float
    total_s: float
    holders_s: float = 0.0  # of dump_s: waiting for terminal holders to answer `dumping`


@dataclass(frozen=True)
class CheckpointResult:
    meta: CheckpointMeta
    path: Path
    timings: CheckpointTimings


@dataclass(frozen=True)
class CheckpointRequest:
    """What one checkpoint was asked for (Checkpointer.checkpoint's arguments)."""

    tree: ProcessTree
    cgroup: MemoryCgroup | None
    reason: str
    on_frozen: Callable[[Frozen, float], None] | None
    after_signal: Callable[[], None] | None
    requester: int | None
    headroom: int  # the room lifted over the cgroup's limit for the dump (0: none)
    rights_of: int | None
    start: float  # monotonic


@dataclass
class CheckpointRun:
    """One checkpoint from the stop on: what has been done so far, so what is left to undo
    (each step that undoes a thing sets it back to None, False or empty)."""

    frozen: Frozen
    pids: list[int]  # the tree as it stopped
    shielding: bool  # shielded from the OOM killer until stopped (cgroup v2)
    hold: GpuHold | None  # its CUDA state moved off the GPU
    others: Held  # the rest of its cgroup, held stopped while it is dumped
    undo_limit: Callable[[], str | None] | None  # the limits lifted for it, latest first
    terminals: DumpTerminals
    checkpoint_id: str
    left: list[int] = field(default_factory=list)  # reparented out of the tree, let go
    began: bool = False  # the checkpoint's directory exists
    dumped: bool = False  # CRIU has killed the tree: the images are all there is of it
    lock_fd: int | None = None
    frozen_at: float = 0.0
    dumped_at: float = 0.0
