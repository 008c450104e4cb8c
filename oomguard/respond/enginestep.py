"""The checkpoint step for a container podman runs: podman checkpoints it (oomguard never dumps
a container's processes behind its engine's back), into the store's `containers/` directory,
and podman restores it from there, on this node or another (docs/cluster.md).

Before podman is asked, what oomguard holds of the tree is let go: the v2 cgroup freeze the
Actor put on first, and any SIGSTOP an earlier step sent. Podman's runtime freezes the
container's cgroup itself, and CRIU dumps the tasks as they ran. Refused (the next step runs)
without podman or without room in the store; failed and thawed if podman fails."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from oomguard.act.podman import EngineError
from oomguard.config.actions import Step
from oomguard.model.errors import FailedCheckpoint, ProcessGone
from oomguard.observe import events
from oomguard.respond.chainstate import ChainOutcome, ChainResult, ChainRun
from oomguard.respond.steptools import StepTools
from oomguard.sense.owners import PodmanContainer, podman_container
from oomguard.store.names import CONTAINERS_DIR


def podman_of(tools: StepTools, run: ChainRun) -> PodmanContainer | None:
    """A podman container's process (by the victim's own memory cgroup)."""
    try:
        rel = tools.proc.memory_cgroup(run.tree.root.pid) or ""
    except ProcessGone:
        return None
    return podman_container(rel)


def archive_path(store: Path, container: PodmanContainer, wall: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall))
    return store / CONTAINERS_DIR / f"{container.container_id[:12]}-{stamp}.tar.zst"


def refused_for_room(tools: StepTools, step: Step, run: ChainRun, fields: dict[str, Any],
                     what: str = "a checkpoint") -> ChainOutcome | None:
    """Refused (said, the next step named) where the store's file system has less free than
    the tree's resident memory and the rule's margin; None where there is room."""
    store = tools.checkpointer.store.root
    need = run.tree.rss_bytes + run.settings.store_margin
    free = tools.free(store)
    if free >= need:
        return None
    detail = f"store {store} has {free >> 20} MiB free, {what} needs ~{need >> 20} MiB"
    tools.events.publish(events.CheckpointRefused(detail, {**fields, "then": run.then()}))
    return ChainOutcome(ChainResult.REFUSED, str(step), detail)


def checkpoint_podman(tools: StepTools, step: Step, run: ChainRun,
                      container: PodmanContainer) -> ChainOutcome:
    fields = {**run.fields, "container_id": container.container_id}
    if tools.podman is None:
        detail = (f"{container.label}: a container's processes are not dumped behind its "
                  "engine's back, and podman is not set up here ([podman] in the config)")
        tools.events.publish(events.CheckpointRefused(detail, {**fields, "then": run.then()}))
        return ChainOutcome(ChainResult.REFUSED, str(step), detail)
    no_room = refused_for_room(tools, step, run, fields, f"a checkpoint of {container.label}")
    if no_room is not None:
        return no_room
    store = tools.checkpointer.store.root
    if run.after_signal is not None:  # the cgroup's freeze, off: podman's runtime freezes
        run.after_signal()
        run.after_signal = None
    if run.frozen:  # stopped by an earlier step: CRIU would dump them stopped
        tools.freezer.thaw(run.frozen)
        run.frozen = []
    archive = archive_path(store, container, time.time())
    started = tools.clock()
    try:
        tools.podman.checkpoint(container.container_id, archive)
    except (EngineError, OSError) as exc:
        tools.events.publish(events.CheckpointFailed(
            FailedCheckpoint.THAWED, f"podman could not checkpoint {container.label}: {exc}",
            {**fields, "then": run.then()}))
        return ChainOutcome(ChainResult.THAWED, str(step), str(exc))
    tools.log.warning("podman.checkpointed", archive=str(archive),
                      seconds=round(tools.clock() - started, 3),
                      restore=f"podman container restore --import {archive}", **fields)
    return ChainOutcome(ChainResult.CHECKPOINTED, str(step),
                        f"checkpointed by podman to {archive}")
