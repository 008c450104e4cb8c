"""What a chain's run is made of: its settings, its outcomes, and the state its steps share."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomguard.act.frozen import Frozen
from oomguard.cgroup.base import MemoryCgroup
from oomguard.lifecycle.checkpointrun import CheckpointResult
from oomguard.policy.victims import ProcessTree


@dataclass(frozen=True)
class ChainSettings:
    freeze_deadline: float = 60.0
    kill_grace: float = 5.0
    store_margin: int = 256 << 20  # free space wanted beyond the estimated image size
    headroom: int = 64 << 20


class ChainResult(enum.StrEnum):
    """How a chain ended for one victim (the values are what events and metrics say)."""

    CHECKPOINTED = "checkpointed"
    SIGNALLED = "signalled"
    VRAM_FREED = "vram-freed"
    PAGED_OUT = "paged-out"  # in swap, kept stopped until its memory fits (act/pageoutstep.py)
    KILLED = "killed"
    THAWED = "thawed"  # a step failed and the tree runs on
    STOOD_DOWN = "stood-down"  # the pressure passed before a step: thawed, nothing done
    GONE = "gone"  # the victim exited meanwhile
    INCOMPLETE = "incomplete"  # dumped, the commit failed: the memory is free, the images kept
    REFUSED = "refused"  # a step may not run here (no room on disk, a container, ...)


SETTLED = frozenset({ChainResult.CHECKPOINTED, ChainResult.SIGNALLED, ChainResult.VRAM_FREED,
                     ChainResult.KILLED, ChainResult.STOOD_DOWN, ChainResult.INCOMPLETE,
                     ChainResult.PAGED_OUT})
# The tree is no longer there to act on (dumped and gone, exited, killed).
TREE_ENDED = frozenset({ChainResult.CHECKPOINTED, ChainResult.GONE, ChainResult.KILLED,
                        ChainResult.INCOMPLETE})


@dataclass(frozen=True)
class ChainOutcome:
    result: ChainResult
    step: str
    detail: str
    checkpoint: CheckpointResult | None = None

    @property
    def settled(self) -> bool:
        """The pressure was dealt with (no need to try another victim)."""
        return self.result in SETTLED


@dataclass(frozen=True)
class Continue:
    """A step did not end the chain: the next one runs, on the tree as this one left it."""


@dataclass(frozen=True)
class Settled:
    """A step ended the chain with this outcome."""

    outcome: ChainOutcome


CONTINUE = Continue()
StepResult = Continue | Settled


@dataclass
class ChainRun:
    """One chain's run against one victim: what every step reads, and what a step leaves for
    the next (the tasks oomguard holds stopped and since when; every pid the ledger heard
    of, cleared at the end). `on_frozen` and `after_signal` are used once, by the first step
    that stops the tree."""

    tree: ProcessTree
    cgroup: MemoryCgroup | None
    reason: str
    settings: ChainSettings
    still_pressing: Callable[[], bool]
    fields: dict[str, Any]
    on_frozen: Callable[[Frozen, float], None] | None = None
    after_signal: Callable[[], None] | None = None
    frozen: list[int] = field(default_factory=list)
    recorded: list[int] = field(default_factory=list)
    frozen_at: float = 0.0
    next_step: str = ""  # the step after the one running ("": none), for what events say next
    why_not: str = ""  # why a checkpoint of this tree cannot succeed, once a step found out
    rest: tuple[str, ...] = ()  # the kinds of the steps after the one running
    # Why the limit lifted for a failed dump could not be put back (the tree grew into the
    # room above its own limit): the chain then acts at once, down to a kill (chainsteps.py).
    limit_busy: str = ""
    # Tasks of the tree the last run's standby (or a dead daemon) stopped, with their start
    # times: continued at the chain's end unless dumped (ChainRunner._continue_left_over).
    left_over_starts: dict[int, int] = field(default_factory=dict)

    def then(self, otherwise: str = "nothing more: the tree runs on") -> str:
        """What runs after a refused or failed step, as its event says it (`then`)."""
        return self.next_step or otherwise
