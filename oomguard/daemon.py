"""The guard loop: kernel notifications in, decisions out, one checkpoint at a time.

Sleeps in select() until a cgroup's eventfd fires (usage crossing a threshold, an OOM episode),
a signal arrives, or the rescan interval passes. Polls only where notifications are unavailable
or usage sits above the threshold in page cache.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.checkpoint import Checkpointer
from oomguard.config import DaemonConfig, GuardConfig
from oomguard.errors import CgroupGone, CheckpointFailed, ProcessGone
from oomguard.policy import Verdict, build_trees, evaluate, rank_victims
from oomguard.procfs import ProcReader
from oomguard.units import format_size

MAX_VICTIM_ATTEMPTS = 3


@dataclass
class Guard:
    spec: GuardConfig
    cgroup: MemoryCgroup
    eventfds: list[int] = field(default_factory=list)
    armed_limit: int | None = None
    poll_only: bool = False
    watching: bool = False
    oom_kills: int = 0
    present: bool = True


def threshold_marks(limit: int, threshold: float) -> list[int]:
    """Usage levels to be told about: the threshold, and halfway from it to the limit (a second
    chance when the first crossing was page cache that later turned into resident memory)."""
    first = int(limit * threshold)
    second = int(limit * (threshold + (1 - threshold) / 2))
    return sorted({first, second})


class Daemon:
    def __init__(self, config: DaemonConfig, checkpointer: Checkpointer, layout: CgroupLayout,
                 log: Any, *, proc: ProcReader | None = None,
                 clock: Callable[[], float] = time.monotonic, self_pid: int | None = None) -> None:
        self.config = config
        self.checkpointer = checkpointer
        self.layout = layout
        self.log = log
        self.proc = proc or ProcReader()
        self.clock = clock
        self.self_pid = self_pid if self_pid is not None else os.getpid()
        self.guards: list[Guard] = []
        self.selector = selectors.DefaultSelector()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._next_rescan = 0.0

    # -- set-up --------------------------------------------------------------------------------

    def arm(self) -> None:
        thawed = self.checkpointer.ledger.recover()
        if thawed:
            self.log.warning("victim.thawed_after_crash", pids=thawed,
                             explanation="a previous run stopped these and did not finish")
        for spec in self.config.guards:
            for path in spec.cgroups:
                cgroup = open_cgroup(path, self.layout)
                guard = Guard(spec=spec, cgroup=cgroup)
                self.guards.append(guard)
                self._arm_guard(guard)
        self._next_rescan = self.clock() + self.config.rescan_interval

    def _arm_guard(self, guard: Guard) -> None:
        self._disarm(guard)
        try:
            snap = guard.cgroup.snapshot()
        except CgroupGone:
            if guard.present:
                self.log.warning("guard.cgroup_missing", cgroup=str(guard.cgroup.path))
            guard.present = False
            return
        guard.present = True
        guard.armed_limit = snap.limit_bytes
        guard.oom_kills = snap.oom_kills
        detection = "none (no limit)"
        if snap.limit_bytes is not None:
            if guard.spec.events and isinstance(guard.cgroup, V1MemoryCgroup):
                try:
                    for mark in threshold_marks(snap.limit_bytes, guard.spec.threshold):
                        guard.eventfds.append(guard.cgroup.register_threshold(mark))
                    guard.eventfds.append(guard.cgroup.register_oom())
                    detection = "eventfd"
                except OSError as exc:
                    self.log.warning("guard.events_unavailable", cgroup=str(guard.cgroup.path),
                                     error=str(exc))
                    self._disarm(guard)
            guard.poll_only = not guard.eventfds
            if guard.poll_only:
                detection = f"polling every {self.config.poll_interval * 1000:.0f}ms"
            for efd in guard.eventfds:
                self.selector.register(efd, selectors.EVENT_READ, guard)
        self.log.info("guard.armed", cgroup=str(guard.cgroup.path), detection=detection,
                      limit=snap.limit_bytes, threshold=guard.spec.threshold,
                      usage=snap.usage_bytes)
        # Already over the threshold when armed: no crossing will come, look now.
        self._examine(guard, self.clock(), source="arm")

    def _disarm(self, guard: Guard) -> None:
        for efd in guard.eventfds:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(efd)
            os.close(efd)
        guard.eventfds.clear()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop())

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        for guard in self.guards:
            self._disarm(guard)
        self.selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            self.tick()

    def _timeout(self) -> float:
        until_rescan = max(0.0, self._next_rescan - self.clock())
        if any(g.present and (g.poll_only or g.watching) and g.armed_limit is not None
               for g in self.guards):
            return min(self.config.poll_interval, until_rescan)
        return until_rescan

    def tick(self) -> None:
        events = self.selector.select(self._timeout())
        woke = self.clock()
        fired: list[Guard] = []
        for key, _ in events:
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 64)
                continue
            with contextlib.suppress(BlockingIOError):
                os.read(key.fd, 8)  # reset the eventfd counter
            if key.data not in fired:
                fired.append(key.data)
        if self._stopping:
            return
        for guard in fired:
            self._examine(guard, woke, source="event")
        for guard in self.guards:
            if guard not in fired and guard.present and (guard.poll_only or guard.watching):
                self._examine(guard, self.clock(), source="poll")
        if self.clock() >= self._next_rescan:
            self._rescan()
            self._next_rescan = self.clock() + self.config.rescan_interval

    def _rescan(self) -> None:
        for guard in self.guards:
            try:
                snap = guard.cgroup.snapshot()
            except CgroupGone:
                if guard.present:
                    self.log.warning("guard.cgroup_gone", cgroup=str(guard.cgroup.path))
                    self._disarm(guard)
                    guard.present = False
                continue
            if not guard.present or snap.limit_bytes != guard.armed_limit:
                self._arm_guard(guard)
            self._note_oom_kills(guard, snap)

    def _note_oom_kills(self, guard: Guard, snap: MemorySnapshot) -> None:
        if snap.oom_kills > guard.oom_kills:
            self.log.error("oom.kill_seen", cgroup=str(guard.cgroup.path),
                           kills=snap.oom_kills - guard.oom_kills,
                           explanation="the kernel OOM killer acted before oomguard could")
        guard.oom_kills = snap.oom_kills

    # -- decisions and actions ---------------------------------------------------------------

    def _examine(self, guard: Guard, woke: float, source: str) -> None:
        try:
            snap = guard.cgroup.snapshot()
        except CgroupGone:
            return
        self._note_oom_kills(guard, snap)
        decision = evaluate(snap, guard.spec.threshold)
        watching = decision.verdict is Verdict.WATCH
        if watching and not guard.watching:
            self.log.info("threshold.cache_only", cgroup=str(guard.cgroup.path), source=source,
                          usage=snap.usage_bytes, anon=snap.anon_bytes, limit=snap.limit_bytes,
                          explanation="usage is over the threshold in reclaimable page cache; "
                          "polling until it drops")
        guard.watching = watching
        if decision.verdict is not Verdict.ACT:
            return
        self.log.warning("threshold.crossed", cgroup=str(guard.cgroup.path), source=source,
                         usage=snap.usage_bytes, anon=snap.anon_bytes, limit=snap.limit_bytes,
                         reason=decision.reason)
        self._act(guard, snap, woke, decision.reason)

    def protected_pids(self) -> frozenset[int]:
        return frozenset(self.proc.descendants(self.self_pid))

    def _act(self, guard: Guard, snap: MemorySnapshot, woke: float, reason: str) -> None:
        cgroup = guard.cgroup
        try:
            members = self.proc.processes(cgroup.procs())
        except CgroupGone:
            return
        ranked = rank_victims(build_trees(members, self.protected_pids()))
        if not ranked:
            self.log.warning("victim.none", cgroup=str(cgroup.path),
                             explanation="no process in the cgroup may be checkpointed")
            return
        for tree in ranked[:MAX_VICTIM_ATTEMPTS]:
            fields = {"cgroup": str(cgroup.path), "pid": tree.root.pid, "comm": tree.root.comm,
                      "rss": tree.rss_bytes, "tasks": len(tree.members)}
            if self.config.dry_run:
                self.log.warning("victim.chosen", dry_run=True, **fields)
                return

            def frozen(pids: list[int], at: float, fields: dict[str, Any] = fields) -> None:
                self.log.info("victim.frozen", detect_to_frozen_ms=round((at - woke) * 1000, 2),
                              **fields)

            try:
                result = self.checkpointer.checkpoint(
                    tree, cgroup, reason, on_frozen=frozen, headroom=guard.spec.headroom,
                    on_failure=guard.spec.on_failure)
            except ProcessGone:
                self.log.info("victim.gone", **fields)
                continue
            except CheckpointFailed as exc:
                self.log.error("checkpoint.failed", outcome=exc.outcome, error=str(exc), **fields)
                continue
            after = self._usage(cgroup)
            meta, t = result.meta, result.timings
            self.log.warning(
                "checkpoint.done", id=meta.id, image_bytes=meta.image_bytes,
                image=format_size(meta.image_bytes), seconds=round(t.total_s, 3),
                freeze_s=round(t.freeze_s, 3), dump_s=round(t.dump_s, 3),
                commit_s=round(t.commit_s, 3),
                mb_per_s=round(meta.image_bytes / 1e6 / t.dump_s, 1) if t.dump_s else None,
                usage_after=after, path=str(result.path), **fields)
            return

    def _usage(self, cgroup: MemoryCgroup) -> int | None:
        try:
            return cgroup.snapshot().usage_bytes
        except CgroupGone:
            return None
