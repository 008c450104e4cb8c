"""Looking at a guard when something woke the daemon (a kernel event, a due poll, arming) and
deciding whether to act: the cgroup rules (resident memory against the threshold, time to the
limit) and the system rules (the detection plug-ins of oomguard.detect: MemAvailable, PSI).
The decisions are the policy's and the plug-ins'. A cgroup guard's look is one call of
oomguard.policy.guardlook.look_at_cgroup, which takes the guard's history and gives back the
next (kept on the guard in one assignment) with its decision; this module reads the sensors,
logs, schedules the next look and hands the action to the Actor."""

from __future__ import annotations

from collections.abc import Callable
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
from oomguard.detect.registry import first_reason
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.lifecycle.jobroot import job_init
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.observe.decisionlog import DecisionLog
from oomguard.policy.guardlook import CgroupLook, look_at_cgroup, reclaim_counted
from oomguard.policy.jobs import below_namespace_init, lift_to_jobs
from oomguard.policy.preferences import select_victims
from oomguard.policy.pressure import Verdict, evaluate
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
        """One look (policy.guardlook.look_at_cgroup): the guard's history taken and the
        next kept, its next look scheduled, and an action handed to the Actor. `limit_busy`:
        why a limit lifted for a dump could not be put back (the cgroup grew into the room):
        its trees are acted on even where a checkpoint was refused for good, through the chain
        down to a kill (oomguard/respond/chainsteps.py)."""
        try:
            snap = self.checkpointer.own_snapshot(guard.cgroup)  # never a limit we lifted
        except CgroupGone:
            self._cgroup_gone(guard)
            return
        guard.last_snapshot = snap
        self._note_oom_kills(guard, snap)
        look = CgroupLook(snap, self.clock(), self.upkeep.throughput)
        decision, guard.history = look_at_cgroup(
            guard.history, look, guard.spec.threshold, guard.spec.signal_settings(),
            poll_interval=self.config.poll_interval, woken=source == "event",
            poll_only=guard.poll_only)
        if decision.watch_started:
            self.log.info("threshold.cache_only", cgroup=guard.name, source=source,
                          usage=snap.usage_bytes, anon=snap.anon_bytes, limit=snap.limit_bytes,
                          explanation="usage is over the threshold in reclaimable page cache; "
                          "watching until it drops")
        self._set_due(guard, decision.due_at)
        if decision.reason is None:
            self.decisions.forget(guard.name)
            return
        if not self.actor.may_act(guard.name, guard.spec.post_action_delay, self.clock(),
                                  urgent=bool(limit_busy)):
            retry_at = self.actor.retry_at(guard.name)
            if retry_at is not None and retry_at > self.clock():  # looked at again then
                self._set_due(guard, min(guard.due_at or 1e18, retry_at))
            return
        self._say_crossed(guard.name, source=source, usage=snap.usage_bytes,
                          anon=snap.anon_bytes, resident=snap.unreclaimable_bytes,
                          limit=snap.limit_bytes, reason=decision.reason)
        self._act_on_cgroup(guard, snap, woke, decision.reason, decision.over_threshold,
                            limit_busy, decision.fired)

    def reclaim_due(self, guard: CgroupGuard, events: int) -> bool:
        """The kernel's reclaim in the cgroup woke the loop (`events` windows): whether to look
        now (policy.guardlook.reclaim_counted; the count is the guard's history)."""
        due, guard.history = reclaim_counted(guard.history, events, RECLAIM_WINDOW_BYTES)
        return due

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
