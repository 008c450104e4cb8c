"""What a chain's steps act with: the one interface between the steps (chainsteps.py,
pageoutstep.py) and the runner that walks them (chain.py), so neither imports the other.
ChainRunner is one; a test may hand the steps any other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from oomguard.act.freezer import Freezer
    from oomguard.act.kubelet import ContainerCheckpointer
    from oomguard.act.podman import PodmanEngine
    from oomguard.lifecycle.checkpoint import Checkpointer
    from oomguard.observe.events import EventSink
    from oomguard.policy.unfit import UnfitMarks
    from oomguard.respond.chainstate import ChainSettings
    from oomguard.respond.pageoutstep import PageoutTools
    from oomguard.sense.procfs import ProcReader


class StepTools(Protocol):
    checkpointer: Checkpointer
    freezer: Freezer
    proc: ProcReader
    log: Any
    events: EventSink  # refused, failed, killed
    marks: UnfitMarks  # trees no checkpoint can take while they live
    containers: ContainerCheckpointer | None
    podman: PodmanEngine | None
    pageout: PageoutTools  # the page-out step's record and swap files
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    free: Callable[[Path], int]  # free bytes on a path's file system

    def alive(self, pid: int) -> bool:
        """Whether the process is alive (not a zombie)."""

    def end_tree(self, pids: list[int], settings: ChainSettings, reason: str,
                 fields: dict[str, Any]) -> None:
        """The chain's kill: SIGTERM, the rule's grace, then SIGKILL, and the event said."""
