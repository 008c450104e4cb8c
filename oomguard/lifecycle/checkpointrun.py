"""One checkpoint as it goes: what it was asked for (CheckpointRequest), what its steps have
done so far and so what is left to undo (CheckpointRun), and what it gives back
(CheckpointResult, with its CheckpointTimings). oomguard.lifecycle.checkpoint walks it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.act.bystanders import Held
from oomguard.act.frozen import Frozen
from oomguard.cgroup.base import MemoryCgroup
from oomguard.gpu.offload import GpuHold
from oomguard.policy.budget import BudgetReading
from oomguard.policy.victims import ProcessTree
from oomguard.store.budget import Reservation
from oomguard.store.checkpoints import CheckpointMeta
from oomguard.store.digest import Digests
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
    """One checkpoint as its steps go: what they have done so far, what each undo needs,
    and what the failure's words take from them (each undo that is over sets its thing back
    to None, False or empty)."""

    terminals: DumpTerminals  # the tree's terminal holders, told of the dump
    held: list[int] = field(default_factory=list)  # stopped by oomguard already (a chain's freeze)
    room: Reservation | None = None  # the store's budget held for the images
    frozen: Frozen = field(default_factory=lambda: Frozen(pids=[]))
    stopped: bool = False  # SIGSTOP sent: a failure from here on is a failed dump, thawed
    shielding: bool = False  # shielded from the OOM killer until stopped (cgroup v2)
    hold: GpuHold | None = None  # its CUDA state moved off the GPU
    others: Held = field(default_factory=Held)  # the rest of its cgroup, held stopped
    undo_limit: Callable[[], str | None] | None = None  # the limits lifted for it, latest first
    checkpoint_id: str = ""
    meta: CheckpointMeta | None = None  # the new checkpoint's description, once stopped
    began: bool = False  # the checkpoint's directory exists
    dumped: bool = False  # CRIU has killed the tree: the images are all there is of it
    lock_fd: int | None = None
    digests: Digests | None = None  # the images' checksums, as CRIU wrote them
    path: Path | None = None  # the committed checkpoint
    frozen_at: float = 0.0
    dumped_at: float = 0.0
    done_at: float = 0.0
    # What a failure's words take from the undos: why the lifted limit could not be put back,
    # the GPU's, and the budget's figures where the store's disk filled.
    busy: str = ""
    gpu_note: str = ""
    full: BudgetReading | None = None

    @property
    def pids(self) -> list[int]:
        """The tree as it stopped (none before the stop)."""
        return self.frozen.pids

    @property
    def left(self) -> list[int]:
        """Reparented out of the tree before it stopped: let go."""
        return self.frozen.left
