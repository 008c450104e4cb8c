"""Running a rule's action chain against one victim tree, step by step, until one settles it.

Every step is bounded in time (CRIU's timeout, a signal's grace, the kill grace), a frozen tree
is never left frozen (the chain ends by dumping, thawing or killing it, and gives up a freeze
past `freeze_deadline`), a task the user had stopped is never continued, and before each step
the pressure is re-read: if it has passed, the chain stands down and thaws.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.act.freezer import Freezer, kill_tree
from oomguard.act.frozen import USER_STOPPED_STATE, Frozen
from oomguard.act.kubelet import ContainerCheckpointer
from oomguard.act.podman import PodmanEngine
from oomguard.cgroup.base import MemoryCgroup
from oomguard.config.actions import Step
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.model.errors import ProcessGone
from oomguard.observe.events import EventSink, VictimKilled, sink_for
from oomguard.policy.unfit import UnfitMarks
from oomguard.policy.victims import ProcessTree
from oomguard.respond.chainstate import (
    ChainOutcome,
    ChainResult,
    ChainRun,
    ChainSettings,
    Settled,
)
from oomguard.respond.chainsteps import StepAction, step_actions
from oomguard.respond.pageoutstep import PageoutTools
from oomguard.sense.procfs import ProcReader

__all__ = ["ChainOutcome", "ChainResult", "ChainRunner", "ChainSettings", "free_space"]


def free_space(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


class ChainRunner:
    """Walks a chain: before each step after the first, the pressure is asked again and the
    freeze deadline checked; each step is run by its object (oomguard/respond/chainsteps.py)."""

    def __init__(self, checkpointer: Checkpointer, freezer: Freezer, proc: ProcReader,
                 log: Any, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 free: Callable[[Path], int] = free_space,
                 containers: ContainerCheckpointer | None = None,
                 podman: PodmanEngine | None = None,
                 events: EventSink | None = None, marks: UnfitMarks | None = None,
                 pageout: PageoutTools | None = None) -> None:
        self.checkpointer = checkpointer
        # The page-out step's record and swap files, in the checkpoints' store.
        self.pageout = pageout or PageoutTools.for_store(checkpointer.store.state)
        # Trees no checkpoint can take while they live: never chosen again (policy/unfit.py).
        self.marks = marks if marks is not None else UnfitMarks(lambda pid: proc.starttime(pid))
        self.containers = containers
        self.podman = podman  # podman's containers: checkpointed by podman
        self.freezer = freezer
        self.proc = proc
        self.log = log
        self.events = sink_for(log, events)  # refused, failed, killed
        self.clock = clock
        self.sleep = sleep
        self.free = free
        self.actions: dict[str, StepAction] = step_actions(self)

    def run(self, chain: tuple[Step, ...], tree: ProcessTree, cgroup: MemoryCgroup | None,
            reason: str, settings: ChainSettings, still_pressing: Callable[[], bool],
            fields: dict[str, Any],
            on_frozen: Callable[[Frozen, float], None] | None = None,
            after_signal: Callable[[], None] | None = None,
            limit_busy: str = "") -> ChainOutcome:
        """`limit_busy`: why the cgroup's limit, lifted for an earlier dump, could not be put
        back: the chain goes down to a kill if it must (chainsteps.CheckpointAction)."""
        run = ChainRun(tree, cgroup, reason, settings, still_pressing, fields, on_frozen,
                       after_signal, recorded=list(tree.pids), limit_busy=limit_busy)
        # Stopped by the last run's standby (or a dead daemon) and held for this action: once
        # it ends, what was not dumped runs on, as what this chain stopped does (their ledger
        # entries go with this chain's: left stopped, they would read as stopped by the user).
        with contextlib.suppress(OSError):
            left = set(self.checkpointer.ledger.left_over(list(tree.pids)))
            run.left_over_starts = {p.pid: p.starttime for p in tree.members if p.pid in left}
        try:
            for index, step in enumerate(chain):
                # (A limit that could not be put back is pressure whatever the usage says.)
                if index and not run.limit_busy and not still_pressing():
                    return ChainOutcome(ChainResult.STOOD_DOWN, str(step), "the pressure passed")
                if run.frozen and self.clock() - run.frozen_at > settings.freeze_deadline:
                    return ChainOutcome(ChainResult.THAWED, str(step),
                                        f"freeze deadline ({settings.freeze_deadline:g}s) passed")
                run.next_step = str(chain[index + 1]) if index + 1 < len(chain) else ""
                run.rest = tuple(later.kind for later in chain[index + 1:])
                result = self.actions[step.kind].run(step, run)
                if isinstance(result, Settled):
                    return result.outcome
            return ChainOutcome(ChainResult.THAWED, str(chain[-1]), "no action settled it")
        except ProcessGone:
            return ChainOutcome(ChainResult.GONE, "", "the victim exited")
        finally:
            if run.frozen:
                self.freezer.thaw(run.frozen)
            self._continue_left_over(run)
            with contextlib.suppress(OSError):
                self.checkpointer.ledger.clear(run.recorded)

    def _continue_left_over(self, run: ChainRun) -> None:
        """SIGCONT what the standby (or a dead run) had stopped and this chain did not dump:
        the same processes (start time), still stopped."""
        continued = []
        for pid, started in run.left_over_starts.items():
            try:
                stat = self.proc.stat(pid)
            except ProcessGone:
                continue
            if stat.starttime != started or stat.state != USER_STOPPED_STATE:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                continued.append(pid)
        if continued:
            self.log.warning("victim.thawed_after_crash", thawed=[str(p) for p in continued],
                             explanation="stopped while no daemon ran (the standby) and held "
                             "for the action on its cgroup, which has ended without dumping it")

    def end_tree(self, pids: list[int], settings: ChainSettings, reason: str,
                 fields: dict[str, Any]) -> None:
        """The chain's kill: SIGTERM (and SIGCONT, so a stopped task can act on it), the
        rule's grace, then SIGKILL what is left (freezer.kill_tree), and the event said."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)
        deadline = self.clock() + settings.kill_grace
        while self.clock() < deadline and any(self.alive(pid) for pid in pids):
            self.sleep(0.05)
        survivors = [pid for pid in pids if self.alive(pid)]
        kill_tree(survivors)
        self.events.publish(VictimKilled(reason, len(survivors), fields))

    def alive(self, pid: int) -> bool:
        try:
            return self.proc.state(pid) not in "ZX"
        except ProcessGone:
            return False
