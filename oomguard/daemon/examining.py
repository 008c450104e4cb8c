"""Looking at a guard when something woke the daemon (a kernel event, a due poll, arming) and
deciding whether to act: the cgroup rules (resident memory against the threshold, time to the
limit) and the system rules (the detection plug-ins of oomguard.detect: MemAvailable, PSI).
The decisions are the policy's and the plug-ins'; this module reads the sensors, schedules the
next look and hands the action to the Actor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot, subtree_procs
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.cgroup.v1 import RECLAIM_WINDOW_BYTES
from oomguard.cgroup.watch import freezable
from oomguard.config.loading import DaemonConfig
from oomguard.daemon.guards import CgroupGuard, Guard, SystemGuard
from oomguard.daemon.storeupkeep import StoreUpkeep
from oomguard.detect.base import CgroupSignal
from oomguard.detect.registry import after_action, first_reason, judge_cgroup, polling
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.lifecycle.jobroot import job_init
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.observe.decisionlog import DecisionLog
from oomguard.policy.jobs import below_namespace_init, lift_to_jobs
from oomguard.policy.preferences import select_victims
from oomguard.policy.pressure import (
    CacheWatch,
    Verdict,
    evaluate,
    reclaim_due,
    reclaim_room,
    watch_next,
)
from oomguard.policy.systemrule import in_cgroups, next_poll, preparing
from oomguard.policy.victims import (
    ProcessTree,
    build_trees,
    system_candidates,
    system_heads,
    system_tree,
)
from oomguard.respond.actor import Actor, Request
from oomguard.sense.newcomers import Newcomers
from oomguard.sense.procfs import ProcessInfo, ProcReader
from oomguard.sense.ranking import ProcessRanking, stand_in
from oomguard.sense.systemlook import PRESSURE_FILE, SystemLook

PARKED_RETRY = 2.0  # v1: tasks wait at the limit and nothing acted yet: look again this soon


@dataclass(frozen=True)
class CgroupLook:
    """One look at a guarded cgroup, as the cgroup detection plug-ins read it
    (oomguard.detect.base.CgroupReadings)."""

    snapshot: MemorySnapshot
    now: float
    dump_throughput: float

    @property
    def usage_bytes(self) -> int:
        return self.snapshot.usage_bytes

    @property
    def anon_bytes(self) -> int:
        return self.snapshot.anon_bytes

    @property
    def limit_bytes(self) -> int | None:
        return self.snapshot.limit_bytes


class Examiner:
    """Looks at a guard and decides. Owns when the system rule is looked at next
    (`next_system_poll`); the guards' own schedule and their end are the daemon's, reached
    through the callables it gives (`set_due`, `cgroup_gone`, `note_oom_kills`,
    `protected_among`), and the config is read as it is now (a reload replaces it)."""

    def __init__(self, *, config: Callable[[], DaemonConfig], layout: CgroupLayout, log: Any,
                 proc: ProcReader, clock: Callable[[], float], meminfo: Callable[[], Any],
                 checkpointer: Checkpointer, actor: Actor, decisions: DecisionLog,
                 upkeep: StoreUpkeep, ranking: ProcessRanking, newcomers: Newcomers,
                 cgroup_gone: Callable[[CgroupGuard], None],
                 set_due: Callable[[CgroupGuard, float | None], None],
                 note_oom_kills: Callable[[CgroupGuard, MemorySnapshot], None],
                 protected_among: Callable[[list[ProcessInfo]], frozenset[int]],
                 pressure_file: Path = PRESSURE_FILE) -> None:
        self._config = config
        self.layout = layout
        self.log = log
        self.proc = proc
        self.clock = clock
        self.meminfo = meminfo
        self.checkpointer = checkpointer
        self.actor = actor
        self.decisions = decisions
        self.upkeep = upkeep
        self.ranking = ranking
        self.newcomers = newcomers
        self._cgroup_gone = cgroup_gone
        self._set_due = set_due
        self._note_oom_kills = note_oom_kills
        self.protected_among = protected_among
        self.next_system_poll = 0.0
        self.pressure_file = pressure_file

    @property
    def config(self) -> DaemonConfig:
        return self._config()

    def examine(self, guard: Guard, woke: float, source: str) -> None:
        if isinstance(guard, SystemGuard):
            self._examine_system(guard, woke, source)
        else:
            self.examine_cgroup(guard, woke, source)

    # -- cgroup rules ----------------------------------------------------------------------------

    def examine_cgroup(self, guard: CgroupGuard, woke: float, source: str,
                        limit_busy: str = "") -> None:
        """`limit_busy`: why a limit lifted for a dump could not be put back (the cgroup grew
        into the room): its trees are acted on even where a checkpoint was refused for good,
        through the chain down to a kill (oomguard/respond/chainsteps.py)."""
        try:
            snap = self.checkpointer.own_snapshot(guard.cgroup)  # never a limit we lifted
        except CgroupGone:
            self._cgroup_gone(guard)
            return
        guard.last_snapshot = snap
        guard.reclaim_room = reclaim_room(snap, guard.spec.threshold)
        guard.reclaim_events = 0
        self._note_oom_kills(guard, snap)
        decision = evaluate(snap, guard.spec.threshold)
        watching = decision.verdict is Verdict.WATCH
        if watching and not guard.watching:
            self.log.info("threshold.cache_only", cgroup=guard.name, source=source,
                          usage=snap.usage_bytes, anon=snap.anon_bytes, limit=snap.limit_bytes,
                          explanation="usage is over the threshold in reclaimable page cache; "
                          "watching until it drops")
        guard.watching = watching
        reason = decision.reason
        fired, predicted = None, None
        if decision.verdict is not Verdict.ACT:
            fired, predicted = self._judge_signals(guard, snap)
        self._schedule(guard, snap, woken=source == "event")
        if decision.verdict is not Verdict.ACT:
            if predicted is None:
                self.decisions.forget(guard.name)
                return
            reason = predicted
        else:
            guard.signal_states = after_action(guard.signal_states)
        if snap.under_oom:  # parked at the limit: never left waiting for an event
            self._set_due(guard, min(guard.due_at or 1e18, self.clock() + PARKED_RETRY))
        if not self.actor.may_act(guard.name, guard.spec.post_action_delay, self.clock(),
                                  urgent=bool(limit_busy)):
            retry_at = self.actor.retry_at(guard.name)
            if retry_at is not None and retry_at > self.clock():  # looked at again then
                self._set_due(guard, min(guard.due_at or 1e18, retry_at))
            return
        self._say_crossed(guard.name, source=source, usage=snap.usage_bytes,
                          anon=snap.anon_bytes, resident=snap.unreclaimable_bytes,
                          limit=snap.limit_bytes, reason=reason)
        self._act_on_cgroup(guard, snap, woke, reason, decision.verdict is Verdict.ACT,
                            limit_busy, fired)

    def reclaim_due(self, guard: CgroupGuard, events: int) -> bool:
        """The kernel's reclaim in the cgroup woke the loop (`events` windows): whether to look
        now (see policy.pressure.reclaim_due)."""
        guard.reclaim_events += events
        return reclaim_due(guard.reclaim_events, guard.reclaim_room, RECLAIM_WINDOW_BYTES)

    def _schedule(self, guard: CgroupGuard, snap: MemorySnapshot, woken: bool = False) -> None:
        """When to look at this guard again without an event: a cache-only watch follows the
        growth of resident memory (measured afresh after a wake-up by the kernel);
        time-to-limit and polled guards every poll_interval."""
        now = self.clock()
        due: float | None = None
        if guard.poll_only or polling(guard.signal_states):
            due = now + self.config.poll_interval
        if guard.watching and snap.limit_bytes is not None:
            delay, guard.cache_watch = watch_next(
                guard.cache_watch, now, snap.unreclaimable_bytes,
                snap.limit_bytes * guard.spec.threshold, woken, self.config.poll_interval)
            due = min(due or 1e18, now + delay)
        else:
            guard.cache_watch = CacheWatch()
        self._set_due(guard, due)

    def _act_on_cgroup(self, guard: CgroupGuard, snap: MemorySnapshot, woke: float, reason: str,
                       acting: bool, limit_busy: str = "",
                       fired: CgroupSignal | None = None) -> None:
        """`acting`: over the threshold; else on the reason of the plug-in that `fired`, which
        goes on while resident memory stays above where it watches from (or the threshold)."""
        cgroup = guard.cgroup
        threshold = guard.spec.threshold
        watched = fired.watched_from(guard.spec.signal_settings()) if fired is not None else None
        floor = 0 if acting else int((snap.limit_bytes or 0) * min(threshold, watched or 1.0))

        def still_pressing() -> bool:
            try:
                now = self.checkpointer.own_snapshot(cgroup)
            except CgroupGone:
                return False
            if floor:
                return now.unreclaimable_bytes >= floor
            return evaluate(now, threshold).verdict is Verdict.ACT

        def candidates() -> list[ProcessTree]:
            try:
                members = self.proc.processes(subtree_procs(cgroup.path))
            except CgroupGone:
                return []
            return select_victims(build_trees(members, self.protected_among(members),
                                              guard.spec.take_sessions), self._vram())

        assert guard.parts is not None
        freeze = freezable(cgroup) if guard.spec.freeze_cgroup and acting else None
        self.actor.start(Request(guard.name, guard.parts, woke, reason, candidates,
                                 lambda tree: cgroup, still_pressing, freeze,
                                 limit_busy=limit_busy))

    def _say_crossed(self, name: str, **fields: Any) -> None:
        """threshold.crossed; in a dry run, where nothing ends the condition, once (then
        once a minute) until the condition is over; so too while the rule's last action found
        only trees no checkpoint can take, which it leaves running (Actor.left_alone)."""
        quiet = self.config.dry_run or self.actor.left_alone(name)
        if quiet and self.decisions.due(name, "crossed", True) is None:
            return
        self.log.warning("threshold.crossed", cgroup=name, **fields)

    def _judge_signals(self, guard: CgroupGuard,
                       snap: MemorySnapshot) -> tuple[CgroupSignal | None, str | None]:
        """The cgroup detection plug-ins (time-to-limit...): each takes its state from the
        guard's last look and gives back the next; the first with a reason to act names it."""
        look = CgroupLook(snap, self.clock(), self.upkeep.throughput)
        fired, reason, guard.signal_states = judge_cgroup(look, guard.spec.signal_settings(),
                                                          guard.signal_states)
        return fired, reason

    def _vram(self) -> dict[int, int]:
        gpu = self.checkpointer.gpu
        return gpu.vram_by_pid() if gpu is not None and gpu.accounting else {}

    # -- system-wide rules -----------------------------------------------------------------------

    def _examine_system(self, guard: SystemGuard, woke: float, source: str) -> None:
        memory = self.meminfo()
        floor = guard.spec.min_available
        self.next_system_poll = self.clock() + next_poll(
            memory.available, memory.total, floor, self.config.poll_interval)
        near = preparing(memory.available, memory.total, floor)
        self.newcomers.follow(near)  # births since the ranking: fork events
        if near:
            self.ranking.prepare()  # the crossing then reads a few processes, not all
        settings = guard.spec.signal_settings()
        reason = first_reason(SystemLook(memory, self.pressure_file), settings)
        if reason is None:
            self.decisions.forget(guard.name)
            return
        if not self.actor.may_act(guard.name, guard.spec.post_action_delay, self.clock()):
            return
        self._say_crossed(guard.name, source=source, available=memory.available,
                          total=memory.total, reason=reason)

        sessions = guard.spec.take_sessions

        def candidates() -> list[ProcessTree]:
            if guard.spec.victim_cgroups:  # their members only, from their cgroup.procs
                processes = self.proc.processes(self._members_of(guard.spec.victim_cgroups))
            else:  # the ranking kept while memory got low, else every process
                processes = self._ranked_processes(sessions)
            protected = self.protected_among(processes)
            # A large process inside an `oomguard exec` job stands for the whole job.
            trees = lift_to_jobs(system_candidates(processes, protected, take_sessions=sessions),
                                 processes, protected)
            return select_victims(trees, self._vram())

        def refresh(tree: ProcessTree) -> ProcessTree | None:
            return self._refresh_tree(tree, sessions)

        def still_pressing() -> bool:
            look = SystemLook(self.meminfo(), self.pressure_file)
            return first_reason(look, settings) is not None

        assert guard.parts is not None
        self.actor.start(Request(guard.name, guard.parts, woke, reason, candidates,
                                 self.cgroup_of, still_pressing,
                                 refresh=None if guard.spec.victim_cgroups else refresh))
        self.next_system_poll = self.clock()

    def _ranked_processes(self, take_sessions: bool) -> list[ProcessInfo]:
        """A system rule's candidates: with a ranking, the largest processes read afresh, and
        the families of those that would be chosen as the ranking saw them (stand-ins: the
        tree chosen is read in full before anything is done to it, _refresh_tree); without a
        ranking, every process."""
        ranking = self.ranking.current()
        if ranking is None:
            return self.proc.processes(self.proc.all_pids())
        heads = self.proc.processes(self.ranking.to_read(ranking))
        chosen = system_heads(heads, self.protected_among(heads), take_sessions=take_sessions)
        known = {p.pid for p in heads}
        inits = self._job_inits(chosen, known)  # those of the chosen inside an exec job
        known |= {p.pid for p in inits}
        family = [ranking.by_pid[pid] for pid in ranking.family([p.pid for p in chosen + inits])
                  if pid not in known and pid in ranking.by_pid]
        return heads + inits + [stand_in(brief) for brief in family]

    def _job_inits(self, chosen: list[ProcessInfo], known: set[int]) -> list[ProcessInfo]:
        """The PID namespace inits (read in full) of those of `chosen` inside an `oomguard
        exec` job, not among `known`: the tree taken is the job's, from its init."""
        inits: dict[int, ProcessInfo] = {}
        for head in chosen:
            if below_namespace_init(head):
                init = job_init(self.proc, head)
                if init is not None and init.pid not in known:
                    inits[init.pid] = init
        return list(inits.values())

    def _refresh_tree(self, tree: ProcessTree, take_sessions: bool) -> ProcessTree | None:
        """A tree ranked from the ranking's readings, read afresh (None: its root is gone)."""
        fresh = self.proc.processes(list(tree.pids))
        return system_tree(tree.root.pid, fresh, self.protected_among(fresh), take_sessions)

    def _members_of(self, roots: tuple[str, ...]) -> list[int]:
        """The processes in these subtrees of the memory hierarchy (filesystem or hierarchy
        paths, as victim_cgroups holds them): from cgroup.procs, no walk of /proc."""
        mount = str(self.layout.memory_mount or "")
        pids: list[int] = []
        for root in roots:
            inner = root[len(mount):] if mount and root.startswith(mount) else root
            try:
                pids += subtree_procs(Path(mount + "/" + inner.strip("/")).resolve())
            except (CgroupGone, OSError):
                continue
        return list(dict.fromkeys(pids))

    def in_cgroups(self, pid: int, roots: tuple[str, ...]) -> bool:
        try:
            rel = self.proc.memory_cgroup(pid) or "/"
        except ProcessGone:
            return False
        return in_cgroups(rel, str(self.layout.memory_mount or ""), roots)

    def cgroup_of(self, tree: ProcessTree) -> MemoryCgroup | None:
        try:
            rel = self.proc.memory_cgroup(tree.root.pid)
            return open_cgroup(rel, self.layout) if rel and self.layout.memory_mount else None
        except (ProcessGone, ValueError):
            return None
