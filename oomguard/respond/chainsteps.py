"""A chain's steps as objects: each runs one kind of action on the victim and says whether
that ended the chain (Settled, with the outcome) or the next step runs (Continue).

The registry (`step_actions`) maps each kind of oomguard.config.actions to its object; the runner
(oomguard/respond/chain.py) only walks the chain, checks the pressure and the freeze deadline
between steps, and thaws whatever is still held at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import TYPE_CHECKING, Protocol

from oomguard.act.frozen import USER_STOPPED_STATE
from oomguard.act.kubelet import KubeletError
from oomguard.config.actions import CHECKPOINT, FREEZE, KILL, PAGEOUT, SIGNAL, VRAM, Step
from oomguard.gpu.cudackpt import CudaCheckpointError
from oomguard.lifecycle.checkpoint import OUTCOME_INCOMPLETE
from oomguard.model.errors import (
    CheckpointFailed,
    FailedCheckpoint,
    ProcessGone,
    StoreOverBudget,
)
from oomguard.observe import events
from oomguard.respond.chainstate import (
    CONTINUE,
    TREE_ENDED,
    ChainOutcome,
    ChainResult,
    ChainRun,
    Settled,
    StepResult,
)
from oomguard.respond.enginestep import checkpoint_podman, podman_of, refused_for_room
from oomguard.respond.pageoutstep import PageoutAction
from oomguard.sense.owners import KubeContainer, kube_container

if TYPE_CHECKING:
    from oomguard.respond.steptools import StepTools


class StepAction(Protocol):
    def run(self, step: Step, run: ChainRun) -> StepResult: ...


class FreezeAction:
    """SIGSTOP the tree and wait until it is stopped (children forked meanwhile too); tasks
    the user stopped are left as they were. Never settles: it holds the tree for the next."""

    def __init__(self, tools: StepTools) -> None:
        self.tools = tools

    def run(self, step: Step, run: ChainRun) -> StepResult:
        freezer, ledger, tree = self.tools.freezer, self.tools.checkpointer.ledger, run.tree
        ledger.record([p.pid for p in tree.members if p.state != USER_STOPPED_STATE])
        held = freezer.freeze(tree.root.pid)
        run.frozen = held.ours
        ledger.record(run.frozen)
        run.recorded += held.pids
        if run.after_signal is not None:
            run.after_signal()
            run.after_signal = None
        held = freezer.wait_frozen(held, 5.0)
        caught = [pid for pid in held.ours if pid not in run.frozen]
        run.frozen = held.ours
        if caught:
            ledger.record(caught)
            run.recorded += caught
        # Stopped by the user too: left stopped, like those found stopped.
        again = freezer.stopped_again(run.frozen)
        run.frozen = [pid for pid in run.frozen if pid not in again]
        if held.user_stopped or again:
            with contextlib.suppress(OSError):
                ledger.clear(held.user_stopped + again)
        run.frozen_at = self.tools.clock()
        if run.on_frozen is not None:
            run.on_frozen(held, run.frozen_at)
            run.on_frozen = None
        return CONTINUE


class SignalAction:
    """Cooperative: a stopped process cannot handle a signal, so thaw first; then wait for it
    to exit or for the pressure to pass (settled), or the grace to end (the next step)."""

    def __init__(self, tools: StepTools) -> None:
        self.tools = tools

    def run(self, step: Step, run: ChainRun) -> StepResult:
        tools = self.tools
        if run.frozen:
            tools.freezer.thaw(run.frozen)
            run.frozen = []
        root = run.tree.root.pid
        try:
            os.kill(root, step.signal)
        except ProcessLookupError:
            return Settled(ChainOutcome(ChainResult.GONE, str(step), "the victim exited"))
        tools.log.warning("victim.signalled", signal=signal.Signals(step.signal).name,
                          grace_s=step.grace, **run.fields)
        deadline = tools.clock() + step.grace
        while tools.clock() < deadline:
            if not tools.alive(root):
                return Settled(ChainOutcome(ChainResult.SIGNALLED, str(step), "the victim exited"))
            if not run.still_pressing():
                return Settled(ChainOutcome(ChainResult.SIGNALLED, str(step), "the victim shrank"))
            tools.sleep(0.1)
        return CONTINUE


class VramAction:
    """GPU memory freed, the process kept alive: its CUDA state moved into its host memory by
    cuda-checkpoint (`oomguard gpu-resume PID` moves it back). The next step runs where the
    tree holds no GPU memory, there is no cuda-checkpoint, or it failed and was undone."""

    def __init__(self, tools: StepTools) -> None:
        self.tools = tools

    def run(self, step: Step, run: ChainRun) -> StepResult:
        tools = self.tools
        if run.frozen:  # cuda-checkpoint needs the process running
            tools.freezer.thaw(run.frozen)
            run.frozen = []
        gpu = tools.checkpointer.gpu
        if gpu is None or not gpu.drives_cuda:
            why = gpu.why if gpu is not None else "GPU support is off"
            tools.log.warning("gpu.vram_skipped", reason=f"no cuda-checkpoint: {why}",
                              **run.fields)
            return CONTINUE
        vram = gpu.vram_by_pid()
        pids = gpu.gpu_pids(run.tree.pids, vram)
        if not pids:
            tools.log.info("gpu.vram_skipped", reason="the tree holds no GPU memory", **run.fields)
            return CONTINUE
        try:
            gpu.suspend(pids)
        except CudaCheckpointError as exc:
            tools.log.error("gpu.vram_failed", error=str(exc), outcome="running on the GPU",
                            **run.fields)
            return CONTINUE
        freed = sum(vram[pid] for pid in pids)
        tools.log.warning("gpu.vram_freed", gpu_pids=pids, vram=freed, **run.fields)
        return Settled(ChainOutcome(ChainResult.VRAM_FREED, str(step),
                                    f"CUDA state of pid(s) {', '.join(map(str, pids))} moved "
                                    "to host memory; `oomguard gpu-resume PID` puts it back "
                                    "on the GPU"))


class CheckpointAction:
    """Dump the tree with CRIU (a Kubernetes container's through its kubelet, a podman
    container's through podman: enginestep.py). Settled once the tree is gone (dumped, or
    dumped with the commit failed, or exited); refused (no room in the store, a container
    without its engine) or failed and thawed: the next step."""

    def __init__(self, tools: StepTools) -> None:
        self.tools = tools

    def run(self, step: Step, run: ChainRun) -> StepResult:
        outcome = self._checkpoint(step, run)
        if outcome.result is not ChainResult.REFUSED:
            run.after_signal = None  # called once the checkpoint had stopped the tree
        # Refused before the stop (a traced tree, no room, a container): the checkpoint never
        # called it, so a cgroup v2 freeze is still on; the next step that stops the tree (a
        # page-out's freeze) thaws the cgroup once its SIGSTOPs are sent, or the tree would
        # wait in the cgroup's freezer, never stopped (the v2 lane's traced job, issue 29).
        if outcome.result in TREE_ENDED:
            run.frozen = []
            return Settled(outcome)
        if outcome.result is ChainResult.THAWED:  # the checkpoint failed and thawed it
            run.frozen = []
        if run.limit_busy and KILL not in run.rest:
            # The room lifted for the dump was never the tree's, and it took it: the limit
            # must come back, and only the end of the tree brings it back. Once, at once.
            return KillAction(self.tools).run(Step(KILL), run)
        return CONTINUE

    def _checkpoint(self, step: Step, run: ChainRun) -> ChainOutcome:
        tools, tree, fields = self.tools, run.tree, run.fields
        container = self._container_of(run)
        if container is not None:
            return self._checkpoint_container(step, run, container)
        engine_container = podman_of(tools, run)
        if engine_container is not None:
            return checkpoint_podman(tools, step, run, engine_container)
        marked = tools.marks.reason(tree)
        if marked is not None:  # refused for good before: taken again only to page it out
            said = {**fields, "lasting": True, "then": run.then("nothing more")}
            tools.events.publish(events.CheckpointRefused(
                f"refused before, for as long as it lives: {marked}", said))
            run.why_not = marked
            return ChainOutcome(ChainResult.REFUSED, str(step), marked)
        no_room = refused_for_room(tools, step, run, fields)
        if no_room is not None:
            return no_room
        try:
            result = tools.checkpointer.checkpoint(
                tree, run.cgroup, run.reason, on_frozen=run.on_frozen,
                headroom=run.settings.headroom, after_signal=run.after_signal, held=run.frozen)
        except StoreOverBudget as exc:  # no room in the store's budget: the next step runs
            said = {**fields, **exc.budget, "then": run.then()}
            untouched = exc.outcome == FailedCheckpoint.UNTOUCHED
            tools.events.publish(events.CheckpointRefused(str(exc), said))
            return ChainOutcome(ChainResult.REFUSED if untouched else ChainResult.THAWED,
                                str(step), str(exc))
        except CheckpointFailed as exc:
            if exc.limit_busy:
                run.limit_busy = exc.limit_busy
                fields = {**fields, "limit_busy": exc.limit_busy,
                          "then": "kill (the limit lifted for the dump must come back)"}
            if exc.lasting:
                return self._unfit(step, run, exc)
            tools.events.publish(events.CheckpointFailed(exc.outcome, str(exc), fields))
            if exc.outcome == OUTCOME_INCOMPLETE:  # the memory is free: nothing more to do
                return ChainOutcome(ChainResult.INCOMPLETE, str(step), str(exc))
            ended = ChainResult.REFUSED if exc.outcome == FailedCheckpoint.UNTOUCHED \
                else ChainResult.THAWED
            return ChainOutcome(ended, str(step), str(exc))
        return ChainOutcome(ChainResult.CHECKPOINTED, str(step), run.reason, result)

    def _unfit(self, step: Step, run: ChainRun, exc: CheckpointFailed) -> ChainOutcome:
        """No checkpoint of this tree can succeed while it lives: said once, with what comes
        next; the tree is marked, so no later crossing chooses it again (policy/unfit.py)."""
        tools, tree = self.tools, run.tree
        untouched = exc.outcome == FailedCheckpoint.UNTOUCHED
        tools.marks.mark(tree, exc.lasting, known_before=untouched and bool(tree.unfit))
        run.why_not = exc.lasting
        then = run.then("the next victim, if one is worth it; this tree runs on and "
                        "is never chosen again while it lives")
        if run.limit_busy:
            then = "kill (the limit lifted for the dump must come back)"
        said = {**run.fields, "lasting": True, "then": then}
        if run.limit_busy:
            said["limit_busy"] = run.limit_busy
        if untouched:
            tools.events.publish(events.CheckpointRefused(exc.lasting, said))
        else:
            tools.events.publish(events.CheckpointFailed(exc.outcome, str(exc),
                                                         {**said, "why": exc.lasting}))
        return ChainOutcome(ChainResult.REFUSED if untouched else ChainResult.THAWED,
                            str(step), exc.lasting)

    def _container_of(self, run: ChainRun) -> KubeContainer | None:
        """A Kubernetes container's process (by the victim's own cgroup)."""
        try:
            rel = self.tools.proc.memory_cgroup(run.tree.root.pid) or ""
        except ProcessGone:
            return None
        found = kube_container(rel)
        return found if found is not None and found.container_id else None

    def _checkpoint_container(self, step: Step, run: ChainRun,
                              container: KubeContainer) -> ChainOutcome:
        """Never dumped behind the container runtime's back: the kubelet checkpoints the
        container (the archive is the checkpoint on disk), then the victim is killed to free
        its memory and the runtime restarts the container per the pod's restartPolicy."""
        tools, fields = self.tools, run.fields
        if tools.containers is None:
            detail = (f"{container.label}: a container's processes are not dumped behind its "
                      "runtime's back, and the kubelet checkpoint API is not set up "
                      "([kubernetes] in the config)")
            tools.events.publish(events.CheckpointRefused(detail, {**fields,
                                                                   "then": run.then()}))
            return ChainOutcome(ChainResult.REFUSED, str(step), detail)
        try:
            ref, archives = tools.containers.checkpoint(container.pod_uid,
                                                        container.container_id)
        except KubeletError as exc:
            tools.events.publish(events.CheckpointFailed(FailedCheckpoint.UNTOUCHED, str(exc),
                                                         fields))
            return ChainOutcome(ChainResult.REFUSED, str(step), str(exc))
        tools.log.warning("kubelet.checkpointed", namespace=ref.namespace, pod=ref.pod,
                          container=ref.container, archives=archives, **fields)
        reason = (f"checkpointed by the kubelet to {archives[0]}; the container restarts per "
                  "its pod's restartPolicy")
        tools.end_tree(list(run.tree.pids), run.settings, reason, fields)
        return ChainOutcome(ChainResult.KILLED, str(step), reason)


class KillAction:
    """The last resort: SIGTERM, then SIGKILL, of the tree and everything held stopped (the
    freeze may have caught a child the tree does not list). Always settles."""

    def __init__(self, tools: StepTools) -> None:
        self.tools = tools

    def run(self, step: Step, run: ChainRun) -> StepResult:
        fields = {**run.fields, "not_checkpointed": run.why_not} if run.why_not else run.fields
        if run.limit_busy:
            fields = {**fields, "limit_busy": run.limit_busy,
                      "explanation": "it grew into the room lifted for its dump, above its "
                      "own limit, and the dump failed: only its end brings the limit back"}
        self.tools.end_tree(sorted(set(run.tree.pids) | set(run.frozen)), run.settings,
                             run.reason, fields)
        run.frozen = []
        return Settled(ChainOutcome(ChainResult.KILLED, KILL, run.reason))


def step_actions(tools: StepTools) -> dict[str, StepAction]:
    """Every kind of step (oomguard.config.actions) and the object that runs it."""
    return {FREEZE: FreezeAction(tools), SIGNAL: SignalAction(tools), VRAM: VramAction(tools),
            CHECKPOINT: CheckpointAction(tools), PAGEOUT: PageoutAction(tools),
            KILL: KillAction(tools)}
