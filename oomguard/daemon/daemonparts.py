"""The Daemon's parts (oomguard/daemon/loop.py), built and wired together: the cgroup side (the
cgroup guards, their arming, what follows the kernel's reports of changes to them, the rules
that make them) and the workers (who does the work the loop decides on: the store's upkeep,
auto-restore, the action chains and their Actor, auto-resume of paged-out trees, the examiner,
the settler, the GPU watch). Each part gets what it needs of the Daemon as values or callables;
what can change (the config after a reload, the standby the app sets) is read when needed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomguard.act.kubelet import ContainerCheckpointer
from oomguard.act.podman import PodmanEngine
from oomguard.act.priority import ThreadPriority
from oomguard.config.loading import DaemonConfig
from oomguard.daemon.autorestore import AutoRestorer
from oomguard.daemon.autoresume import AutoResumer
from oomguard.daemon.cgroupchanges import CgroupChanges
from oomguard.daemon.cgroupguards import CgroupGuards
from oomguard.daemon.examining import Examiner
from oomguard.daemon.gpuwatch import GpuWatch
from oomguard.daemon.guardarming import GuardArming
from oomguard.daemon.rules import Rules
from oomguard.daemon.settling import Settler
from oomguard.daemon.storeupkeep import StoreUpkeep
from oomguard.lifecycle.restore import Restorer
from oomguard.respond.actor import Actor
from oomguard.respond.chain import ChainRunner

if TYPE_CHECKING:
    from oomguard.daemon.loop import Daemon


@dataclass
class CgroupSide:
    guards: CgroupGuards
    arming: GuardArming
    changes: CgroupChanges
    rules: Rules


@dataclass
class Workers:
    upkeep: StoreUpkeep
    auto_restore: AutoRestorer
    priority: ThreadPriority
    auto_resume: AutoResumer
    actor: Actor
    examiner: Examiner
    settler: Settler
    gpu_watch: GpuWatch | None


def cgroup_side(daemon: Daemon, config: DaemonConfig) -> CgroupSide:
    """The cgroup guards (built, found, let go), their arming, what follows the kernel's
    reports of changes to them, and the rules that make them (`config`: the rules at start)."""
    guards = CgroupGuards(
        layout=daemon.layout, log=daemon.log, checkpointer=daemon.checkpointer,
        saved_high=daemon.saved_high, registrations=daemon.registrations, files=daemon.files,
        park_watch=lambda: daemon.park_watch, standby=lambda: daemon.standby,
        guards=daemon.guards)
    arming = GuardArming(
        guards=guards, registrations=daemon.registrations, armer=daemon.armer,
        later_marks=daemon.later_marks, files=daemon.files, checkpointer=daemon.checkpointer,
        saved_high=daemon.saved_high, log=daemon.log, clock=daemon.clock,
        config=lambda: daemon.config,
        examine_cgroup=lambda guard, woke, source: daemon.examine_cgroup(guard, woke, source))
    changes = CgroupChanges(guards=guards, arming=arming, files=daemon.files,
                            checkpointer=daemon.checkpointer)
    rules = Rules(config, layout=daemon.layout, log=daemon.log, meminfo=daemon.meminfo,
                  psi_trigger=daemon.psi_trigger, guards=daemon.guards, cgroup_guards=guards,
                  arming=arming, registrations=daemon.registrations)
    return CgroupSide(guards, arming, changes, rules)


def workers(daemon: Daemon, config: DaemonConfig, restorer: Restorer | None,
            containers: ContainerCheckpointer | None, podman: PodmanEngine | None,
            wall_clock: Callable[[], float]) -> Workers:
    """Who does the work the loop decides on; the cgroup side is built already."""
    checkpointer, clock, log, events = daemon.checkpointer, daemon.clock, daemon.log, daemon.events
    upkeep = StoreUpkeep(checkpointer.store, checkpointer.ledger, config, log,
                         clock=clock, wall_clock=wall_clock, podman=podman)
    checkpointer.on_pruned = upkeep.log_pruned  # made room for a new checkpoint
    auto_restore = AutoRestorer(checkpointer.store, restorer, log, events=events, clock=clock,
                                restored=upkeep.forget_listing)
    priority = ThreadPriority(config.nice)  # the loop's and the action workers'
    chains = ChainRunner(checkpointer, checkpointer.freezer, daemon.proc, log,
                         clock=clock, containers=containers, podman=podman, events=events)
    # Paged-out trees continued once they fit (the chain's pageout step made them).
    auto_resume = AutoResumer(chains.pageout, log, clock=clock)
    actor = Actor(chains, log, dry_run=config.dry_run, on_checkpoint=upkeep.after_dump,
                  clock=clock, decisions=daemon.decisions, on_done=daemon.action_done,
                  priority=priority, events=events)
    cgroup_guards, registrations = daemon.cgroup_guards, daemon.registrations
    examiner = Examiner(
        config=lambda: daemon.config, layout=daemon.layout, log=log, proc=daemon.proc,
        clock=clock, meminfo=daemon.meminfo, checkpointer=checkpointer, actor=actor,
        decisions=daemon.decisions, upkeep=upkeep, ranking=daemon.ranking,
        newcomers=daemon.newcomers, cgroup_gone=lambda guard: cgroup_guards.cgroup_gone(guard),
        set_due=lambda guard, at: registrations.set_due(guard, at),
        note_oom_kills=lambda guard, snap: cgroup_guards.note_oom_kills(guard, snap),
        protected_among=lambda processes: daemon.protected_among(processes))
    settler = Settler(lifts=checkpointer.lifts, own_snapshot=checkpointer.own_snapshot,
                      upkeep=upkeep, auto_restore=auto_restore, auto_resume=auto_resume,
                      actor=actor, proc=daemon.proc, log=log, clock=clock,
                      guards=cgroup_guards.listed, cgroup_at=cgroup_guards.cgroup_at,
                      guard_at=cgroup_guards.guard_at, examine=daemon.examine_cgroup,
                      config=lambda: daemon.config, starting=lambda: daemon.starting)
    upkeep.hold_back = settler.leftover_waits
    upkeep.paged_out = auto_resume.held
    gpu_watch = GpuWatch(checkpointer.gpu, config.gpu.poll_interval, actor, daemon.proc, log,
                         protected=daemon.protected_pids, in_cgroups=examiner.in_cgroups,
                         cgroup_of=examiner.cgroup_of,
                         clock=clock) if checkpointer.gpu is not None else None
    return Workers(upkeep, auto_restore, priority, auto_resume, actor, examiner, settler,
                   gpu_watch)
