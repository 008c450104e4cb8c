"""Running a rule's action chain against one victim tree, step by step, until one settles it.

Every step is bounded in time (CRIU's timeout, a signal's grace, the kill grace), a frozen tree
is never left frozen (the chain ends by dumping, thawing or killing it, and gives up a freeze
past `freeze_deadline`), a task the user had stopped is never continued, and before each step
the pressure is re-read: if it has passed, the chain stands down and thaws.
"""

from __future__ import annotations

import contextlib
import enum
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.act.freezer import USER_STOPPED_STATE, Freezer, Frozen
from oomguard.act.kubelet import ContainerCheckpointer, KubeletError
from oomguard.act.steps import CHECKPOINT, FREEZE, KILL, SIGNAL, VRAM, Step
from oomguard.cgroup.base import MemoryCgroup
from oomguard.gpu.cudackpt import CudaCheckpointError
from oomguard.lifecycle.checkpoint import OUTCOME_INCOMPLETE, Checkpointer, CheckpointResult
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint, ProcessGone
from oomguard.policy.victims import ProcessTree
from oomguard.sense.owners import KubeContainer, kube_container
from oomguard.sense.procfs import ProcReader


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
    KILLED = "killed"
    THAWED = "thawed"  # a step failed and the tree runs on
    STOOD_DOWN = "stood-down"  # the pressure passed before a step: thawed, nothing done
    GONE = "gone"  # the victim exited meanwhile
    INCOMPLETE = "incomplete"  # dumped, the commit failed: the memory is free, the images kept
    REFUSED = "refused"  # a step may not run here (no room on disk, a container, ...)


SETTLED = frozenset({ChainResult.CHECKPOINTED, ChainResult.SIGNALLED, ChainResult.VRAM_FREED,
                     ChainResult.KILLED, ChainResult.STOOD_DOWN, ChainResult.INCOMPLETE})
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


def free_space(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


class ChainRunner:
    def __init__(self, checkpointer: Checkpointer, freezer: Freezer, proc: ProcReader,
                 log: Any, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 free: Callable[[Path], int] = free_space,
                 containers: ContainerCheckpointer | None = None) -> None:
        self.checkpointer = checkpointer
        self.containers = containers
        self.freezer = freezer
        self.proc = proc
        self.log = log
        self.clock = clock
        self.sleep = sleep
        self.free = free

    def run(self, chain: tuple[Step, ...], tree: ProcessTree, cgroup: MemoryCgroup | None,
            reason: str, settings: ChainSettings, still_pressing: Callable[[], bool],
            fields: dict[str, Any],
            on_frozen: Callable[[Frozen, float], None] | None = None,
            after_signal: Callable[[], None] | None = None) -> ChainOutcome:
        frozen: list[int] = []
        recorded: list[int] = list(tree.pids)  # every pid the ledger heard of, to clear at the end
        frozen_at = 0.0
        ledger = self.checkpointer.ledger
        try:
            for index, step in enumerate(chain):
                if index and not still_pressing():
                    return ChainOutcome(ChainResult.STOOD_DOWN, str(step), "the pressure passed")
                if frozen and self.clock() - frozen_at > settings.freeze_deadline:
                    return ChainOutcome(ChainResult.THAWED, str(step),
                                        f"freeze deadline ({settings.freeze_deadline:g}s) passed")
                if step.kind == FREEZE:
                    ledger.record([p.pid for p in tree.members
                                   if p.state != USER_STOPPED_STATE])
                    held = self.freezer.freeze(tree.root.pid)
                    frozen = held.ours
                    ledger.record(frozen)
                    recorded += held.pids
                    if after_signal is not None:
                        after_signal()
                        after_signal = None
                    # Children forked meanwhile (seen on the connector) are stopped too.
                    held = self.freezer.wait_frozen(held, 5.0)
                    caught = [pid for pid in held.ours if pid not in frozen]
                    frozen = held.ours
                    if caught:
                        ledger.record(caught)
                        recorded += caught
                    # Stopped by the user too: left stopped, like those found stopped.
                    again = self.freezer.stopped_again(frozen)
                    frozen = [pid for pid in frozen if pid not in again]
                    if held.user_stopped or again:
                        with contextlib.suppress(OSError):
                            ledger.clear(held.user_stopped + again)
                    frozen_at = self.clock()
                    if on_frozen is not None:
                        on_frozen(held, frozen_at)
                        on_frozen = None
                elif step.kind == SIGNAL:
                    outcome = self._signal(step, tree, frozen, still_pressing, fields)
                    frozen = []
                    if outcome is not None:
                        return outcome
                elif step.kind == VRAM:
                    if frozen:  # cuda-checkpoint needs the process running
                        self.freezer.thaw(frozen)
                        frozen = []
                    outcome = self._vram(step, tree, fields)
                    if outcome is not None:
                        return outcome
                elif step.kind == CHECKPOINT:
                    outcome = self._checkpoint(step, tree, cgroup, reason, settings, fields,
                                               on_frozen, after_signal, frozen)
                    after_signal = None
                    if outcome.result in TREE_ENDED:
                        frozen = []
                        return outcome
                    if outcome.result is ChainResult.THAWED:  # the checkpoint failed and thawed it
                        frozen = []
                elif step.kind == KILL:
                    # Everything stopped goes too: the freeze may have caught a child that is
                    # not in the tree (forked after the scan, or in another cgroup).
                    self._kill(sorted(set(tree.pids) | set(frozen)), settings, reason, fields)
                    frozen = []
                    return ChainOutcome(ChainResult.KILLED, KILL, reason)
            return ChainOutcome(ChainResult.THAWED, str(chain[-1]), "no action settled it")
        except ProcessGone:
            return ChainOutcome(ChainResult.GONE, "", "the victim exited")
        finally:
            if frozen:
                self.freezer.thaw(frozen)
            with contextlib.suppress(OSError):
                ledger.clear(recorded)

    def _signal(self, step: Step, tree: ProcessTree, frozen: list[int],
                still_pressing: Callable[[], bool], fields: dict[str, Any]) -> ChainOutcome | None:
        """Cooperative: a stopped process cannot handle a signal, so thaw first; then wait for
        it to exit or for the pressure to pass."""
        if frozen:
            self.freezer.thaw(frozen)
        try:
            os.kill(tree.root.pid, step.signal)
        except ProcessLookupError:
            return ChainOutcome(ChainResult.GONE, str(step), "the victim exited")
        self.log.warning("victim.signalled", signal=signal.Signals(step.signal).name,
                         grace_s=step.grace, **fields)
        deadline = self.clock() + step.grace
        while self.clock() < deadline:
            if not self._alive(tree.root.pid):
                return ChainOutcome(ChainResult.SIGNALLED, str(step), "the victim exited")
            if not still_pressing():
                return ChainOutcome(ChainResult.SIGNALLED, str(step), "the victim shrank")
            self.sleep(0.1)
        return None

    def _vram(self, step: Step, tree: ProcessTree, fields: dict[str, Any]) -> ChainOutcome | None:
        """GPU memory freed, the process kept alive: its CUDA state moved into its host memory
        by cuda-checkpoint (`oomguard gpu-resume PID` moves it back). None: go on to the next
        step (no GPU memory in the tree, no cuda-checkpoint, or it failed and was undone)."""
        gpu = self.checkpointer.gpu
        if gpu is None or not gpu.drives_cuda:
            why = gpu.why if gpu is not None else "GPU support is off"
            self.log.warning("gpu.vram_skipped", reason=f"no cuda-checkpoint: {why}", **fields)
            return None
        vram = gpu.vram_by_pid()
        pids = gpu.gpu_pids(tree.pids, vram)
        if not pids:
            self.log.info("gpu.vram_skipped", reason="the tree holds no GPU memory", **fields)
            return None
        try:
            gpu.suspend(pids)
        except CudaCheckpointError as exc:
            self.log.error("gpu.vram_failed", error=str(exc), outcome="running on the GPU",
                           **fields)
            return None
        freed = sum(vram[pid] for pid in pids)
        self.log.warning("gpu.vram_freed", gpu_pids=pids, vram=freed, **fields)
        return ChainOutcome(ChainResult.VRAM_FREED, str(step),
                            f"CUDA state of pid(s) {', '.join(map(str, pids))} moved to host "
                            "memory; `oomguard gpu-resume PID` puts it back on the GPU")

    def _checkpoint(self, step: Step, tree: ProcessTree, cgroup: MemoryCgroup | None,
                    reason: str, settings: ChainSettings, fields: dict[str, Any],
                    on_frozen: Callable[[Frozen, float], None] | None,
                    after_signal: Callable[[], None] | None,
                    held: list[int]) -> ChainOutcome:
        container = self._container_of(tree)
        if container is not None:
            return self._checkpoint_container(step, tree, container, settings, fields)
        need = tree.rss_bytes + settings.store_margin
        free = self.free(self.checkpointer.store.root)
        if free < need:
            detail = (f"store {self.checkpointer.store.root} has {free >> 20} MiB free, a "
                      f"checkpoint needs ~{need >> 20} MiB")
            self.log.error("checkpoint.refused", reason=detail, **fields)
            return ChainOutcome(ChainResult.REFUSED, str(step), detail)
        try:
            result = self.checkpointer.checkpoint(
                tree, cgroup, reason, on_frozen=on_frozen, headroom=settings.headroom,
                after_signal=after_signal, held=held)
        except CheckpointFailed as exc:
            self.log.error("checkpoint.failed", outcome=exc.outcome, error=str(exc), **fields)
            if exc.outcome == OUTCOME_INCOMPLETE:  # the memory is free: nothing more to do
                return ChainOutcome(ChainResult.INCOMPLETE, str(step), str(exc))
            ended = ChainResult.REFUSED if exc.outcome == FailedCheckpoint.UNTOUCHED \
                else ChainResult.THAWED
            return ChainOutcome(ended, str(step), str(exc))
        return ChainOutcome(ChainResult.CHECKPOINTED, str(step), reason, result)

    def _container_of(self, tree: ProcessTree) -> KubeContainer | None:
        """A Kubernetes container's process (by the victim's own cgroup)."""
        try:
            rel = self.proc.memory_cgroup(tree.root.pid) or ""
        except ProcessGone:
            return None
        found = kube_container(rel)
        return found if found is not None and found.container_id else None

    def _checkpoint_container(self, step: Step, tree: ProcessTree, container: KubeContainer,
                              settings: ChainSettings, fields: dict[str, Any]) -> ChainOutcome:
        """Never dumped behind the container runtime's back: the kubelet checkpoints the
        container (the archive is the checkpoint on disk), then the victim is killed to free
        its memory and the runtime restarts the container per the pod's restartPolicy."""
        if self.containers is None:
            detail = (f"{container.label}: a container's processes are not dumped behind its "
                      "runtime's back, and the kubelet checkpoint API is not set up "
                      "([kubernetes] in the config)")
            self.log.error("checkpoint.refused", reason=detail, **fields)
            return ChainOutcome(ChainResult.REFUSED, str(step), detail)
        try:
            ref, archives = self.containers.checkpoint(container.pod_uid, container.container_id)
        except KubeletError as exc:
            self.log.error("checkpoint.failed", outcome=FailedCheckpoint.UNTOUCHED, error=str(exc), **fields)
            return ChainOutcome(ChainResult.REFUSED, str(step), str(exc))
        self.log.warning("kubelet.checkpointed", namespace=ref.namespace, pod=ref.pod,
                         container=ref.container, archives=archives, **fields)
        reason = (f"checkpointed by the kubelet to {archives[0]}; the container restarts per "
                  "its pod's restartPolicy")
        self._kill(list(tree.pids), settings, reason, fields)
        return ChainOutcome(ChainResult.KILLED, str(step), reason)

    def _kill(self, pids: list[int], settings: ChainSettings, reason: str,
              fields: dict[str, Any]) -> None:
        """SIGTERM (and SIGCONT, so a stopped task can act on it), then SIGKILL what is left."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)
        deadline = self.clock() + settings.kill_grace
        while self.clock() < deadline and any(self._alive(pid) for pid in pids):
            self.sleep(0.05)
        survivors = [pid for pid in pids if self._alive(pid)]
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.log.error("victim.killed", reason=reason, sigkill=len(survivors),
                       explanation="the rule's last action: no checkpoint was possible", **fields)

    def _alive(self, pid: int) -> bool:
        try:
            return self.proc.state(pid) not in "ZX"
        except ProcessGone:
            return False
