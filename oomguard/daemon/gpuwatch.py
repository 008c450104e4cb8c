"""GPU memory pressure as a trigger. NVML has no events: while at least one rule has a GPU
detection on (oomguard.detect's GPU plug-ins: `gpu_threshold`) the daemon reads NVML every
`[gpu] poll_interval` (2 s by default), and not at all otherwise. A device the rule's plug-in
finds pressed starts the rule's action chain on the tree that holds the most memory on that
device, among the rule's cgroups (a system rule: any process, or those in `victim_cgroups`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from oomguard.cgroup.base import MemoryCgroup, subtree_procs
from oomguard.config.loading import GuardConfig
from oomguard.daemon.guards import CgroupGuard, Guard, SystemGuard
from oomguard.detect.registry import gpu_watching, judge_gpu
from oomguard.gpu.nvml import GpuSnapshot
from oomguard.gpu.runtime import GpuSupport
from oomguard.lifecycle.jobroot import job_root
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.policy.victims import ProcessTree, build_trees, with_vram
from oomguard.respond.actor import Actor, Request
from oomguard.sense.procfs import ProcReader

GPU_SUFFIX = " (GPU)"


def on_devices(snapshot: GpuSnapshot, indexes: set[int]) -> dict[int, int]:
    """VRAM per pid on the given devices only."""
    found: dict[int, int] = {}
    for process in snapshot.processes:
        if process.device_index in indexes:
            found[process.pid] = found.get(process.pid, 0) + (process.used_bytes or 0)
    return found


class GpuWatch:
    def __init__(self, gpu: GpuSupport, interval: float, actor: Actor, proc: ProcReader,
                 log: Any, *, protected: Callable[[], frozenset[int]],
                 in_cgroups: Callable[[int, tuple[str, ...]], bool],
                 cgroup_of: Callable[[ProcessTree], MemoryCgroup | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gpu = gpu
        self.interval = interval
        self.actor = actor
        self.proc = proc
        self.log = log
        self.protected = protected
        self.in_cgroups = in_cgroups
        self.cgroup_of = cgroup_of
        self.clock = clock
        self.next_poll = clock()

    @staticmethod
    def wanted(gpu: GpuSupport | None, specs: Iterable[GuardConfig]) -> bool:
        return gpu is not None and gpu.accounting and any(
            gpu_watching(s.signal_settings()) for s in specs)

    def due_in(self, now: float) -> float:
        return max(0.0, self.next_poll - now)

    def tick(self, guards: list[Guard]) -> None:
        now = self.clock()
        if now < self.next_poll:
            return
        self.next_poll = now + self.interval
        snapshot = self.gpu.snapshot()
        if snapshot is None:
            return
        by_spec: dict[int, list[Guard]] = {}
        for guard in guards:
            if gpu_watching(guard.spec.signal_settings()):
                by_spec.setdefault(id(guard.spec), []).append(guard)
        for members in by_spec.values():
            self._consider(members, snapshot, now)

    def _consider(self, members: list[Guard], snapshot: GpuSnapshot, now: float) -> None:
        spec = members[0].spec
        settings = spec.signal_settings()
        verdict = judge_gpu(snapshot, settings)
        if verdict is None:
            return
        name = members[0].name + GPU_SUFFIX
        if not self.actor.may_act(name, spec.post_action_delay, now):
            return
        indexes = set(verdict.devices)
        reason = verdict.reason
        self.log.warning("threshold.crossed", cgroup=members[0].name, source="gpu",
                         devices=sorted(indexes), reason=reason)

        def candidates() -> list[ProcessTree]:
            current = self.gpu.snapshot()
            if current is None:
                return []
            vram = on_devices(current, indexes)
            trees = [t for t in with_vram(self._trees(members, vram), vram) if t.vram_bytes]
            return sorted(trees, key=lambda t: (-t.vram_bytes, -t.rss_bytes, t.root.pid))

        def still_pressing() -> bool:
            current = self.gpu.snapshot()
            verdict = judge_gpu(current, settings) if current is not None else None
            return verdict is not None and not indexes.isdisjoint(verdict.devices)

        assert members[0].parts is not None
        self.actor.start(Request(name, members[0].parts, now, reason, candidates,
                                 self.cgroup_of, still_pressing))

    def _trees(self, members: list[Guard], vram: dict[int, int]) -> list[ProcessTree]:
        """The trees a rule may act on that hold memory on the pressed devices."""
        protected = self.protected()
        sessions = members[0].spec.take_sessions
        if isinstance(members[0], SystemGuard):
            holders = [pid for pid in vram if not members[0].spec.victim_cgroups
                       or self.in_cgroups(pid, members[0].spec.victim_cgroups)]
            trees = []
            roots: set[int] = set()
            for pid in holders:
                try:  # a holder inside an `oomguard exec` job: the whole job, from its init
                    root = job_root(self.proc, pid, protected)
                    procs = self.proc.processes(self.proc.descendants(root))
                except ProcessGone:
                    continue
                if root not in roots:
                    roots.add(root)
                    trees += [t for t in build_trees(procs, protected, sessions)
                              if t.root.pid == root]
            return trees
        trees = []
        for guard in members:
            assert isinstance(guard, CgroupGuard)
            try:
                procs = self.proc.processes(subtree_procs(guard.cgroup.path))
            except CgroupGone:
                continue
            trees += build_trees(procs, protected, sessions)
        return trees
