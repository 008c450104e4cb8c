"""The guard loop: kernel notifications in, decisions out, one action per guard at a time.

Sleeps in epoll until a watched fd fires (v1 usage thresholds and OOM events, v2 memory.high /
memory.events changes, PSI triggers, inotify on the cgroup filesystem), a signal arrives, or
some work falls due. Nothing is read on a timer while all is quiet: a guard is re-read when one
of its own events fires; polls run only where notifications cannot tell a crossing (v2 without
memory.high, usage over the threshold in page cache, system-wide MemAvailable as it nears the
floor); the safety rescan (rescan_interval) costs one stat(2) per guard.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from oomguard.act.kubelet import ContainerCheckpointer
from oomguard.act.podman import PodmanEngine
from oomguard.cgroup.configchecks import config_warnings
from oomguard.cgroup.mounts import CgroupLayout
from oomguard.cgroup.watch import RECLAIM, consume
from oomguard.config.loading import DaemonConfig
from oomguard.daemon.arming import Armer, LaterMarks
from oomguard.daemon.daemonparts import cgroup_side, workers
from oomguard.daemon.gpuwatch import GpuWatch
from oomguard.daemon.guards import CgroupGuard, Guard, SystemGuard, psi_trigger_for
from oomguard.daemon.parkwatch import ParkWatchdog, park_reason
from oomguard.daemon.registrations import Registrations
from oomguard.daemon.standby import Standby
from oomguard.daemon.status import guard_entries, summary_line
from oomguard.daemon.timers import GpuPolls, GuardPolls, MarksIn, SafetyRescan, Settling, Timer
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.lifecycle.lazyrestore import running_keepers, wait_for_keepers
from oomguard.lifecycle.restore import Restorer
from oomguard.model.wakepipe import WakePipe
from oomguard.observe.decisionlog import DecisionLog
from oomguard.observe.events import EventSink, sink_for
from oomguard.sense.cgroupfiles import CgroupFiles
from oomguard.sense.newcomers import Newcomers
from oomguard.sense.procfs import ProcessInfo, ProcReader
from oomguard.sense.ranking import ProcessRanking
from oomguard.sense.selfguard import ancestors_of, own_family
from oomguard.store.checkpoints import CheckpointMeta
from oomguard.store.ledger import SavedLimits
from oomguard.store.names import SAVED_HIGH

LAZY_STOP_WAIT = 300.0  # at most this long at exit for lazily restored jobs' pages (a unit's
# TimeoutStopSec is 330 s)
STALE_TURN = 10.0  # the loop inside one turn this long: wedged (for the park watchdog's reason)


class Daemon:
    def __init__(self, config: DaemonConfig, checkpointer: Checkpointer, layout: CgroupLayout,
                 log: Any, *, proc: ProcReader | None = None,
                 clock: Callable[[], float] = time.monotonic, self_pid: int | None = None,
                 meminfo: Callable[[], Any] = psutil.virtual_memory,
                 restorer: Restorer | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 containers: ContainerCheckpointer | None = None,
                 podman: PodmanEngine | None = None,
                 files: CgroupFiles | None = None,
                 ranking: ProcessRanking | None = None,
                 poller: Callable[[], Any] = select.epoll,
                 after_arming: Callable[[], None] = lambda: None,
                 events: EventSink | None = None,
                 standby: Standby | None = None) -> None:
        self.after_arming = after_arming  # the daemon's: settle_heap
        self.checkpointer = checkpointer
        self.layout = layout
        self.log = log
        self.events = sink_for(log, events)  # app: RecordingLogger
        self.proc = proc or ProcReader()
        self.clock = clock
        self.self_pid = self_pid if self_pid is not None else os.getpid()
        self.meminfo = meminfo
        self.newcomers = Newcomers()  # fork events while a system rule is near its floor
        self.ranking = ranking or ProcessRanking(self.proc.root, clock=clock,
                                                 newcomers=self.newcomers.since)
        self.guards: list[Guard] = []
        self._open_wakeups(poller, files)
        self.saved_high = SavedLimits(config.node_state_dir / SAVED_HIGH)
        self.psi_trigger = psi_trigger_for()
        self.armer = Armer(checkpointer.own_snapshot, self.saved_high, self.psi_trigger,
                           dry_run=config.dry_run)
        self.later_marks = LaterMarks(self.armer, on_done=lambda: self._wakeup.wake(b"m"))
        self.decisions = DecisionLog(clock)  # a dry run says a lasting decision once
        self.starting = False  # arm() is settling what a dead run (or its standby) left
        self.standby = standby  # guards the parking cgroups while no daemon runs (app's)
        self.registrations = Registrations(self.epoll, self.later_marks, log)
        side = cgroup_side(self, config)  # daemonparts.py
        self.cgroup_guards, self.guard_arming = side.guards, side.arming
        self.cgroup_changes, self.rules = side.changes, side.rules
        parts = workers(self, config, restorer, containers, podman, wall_clock)
        self.upkeep, self.auto_restore = parts.upkeep, parts.auto_restore
        self.priority, self.auto_resume = parts.priority, parts.auto_resume
        self.actor, self.examiner = parts.actor, parts.examiner
        self.settler, self.gpu_watch = parts.settler, parts.gpu_watch
        self._reload = False
        self._gpu_watching = self._wants_gpu_watch()
        self._init_turns()
        self._build_timers()

    def _build_timers(self) -> None:
        """The loop's timed work, in the order it fires (oomguard/daemon/timers.py)."""
        self.rescan = SafetyRescan(lambda: self.cgroup_changes.safety_rescan(), self.settler.settle,
                                   lambda: self.config.rescan_interval, self.clock)
        self.timers: list[Timer] = [
            MarksIn(self.later_marks, lambda: self.registrations.add_later_marks()),
            GuardPolls(self._scheduled_polls, lambda g, now, source: self._examine(g, now, source)),
            GpuPolls(self.gpu_watch, lambda: self._gpu_watching, lambda: self.guards),
            Settling(self.settler, self._acted),
            self.rescan]

    @property
    def config(self) -> DaemonConfig:
        """The config in force (a reload replaces it)."""
        return self.rules.config

    def _examine(self, guard: Guard, woke: float, source: str) -> None:
        self.examiner.examine(guard, woke, source)

    def examine_cgroup(self, guard: CgroupGuard, woke: float, source: str,
                       limit_busy: str = "") -> None:
        """A cgroup guard looked at now (asked by the arming and the settler too)."""
        self.examiner.examine_cgroup(guard, woke, source, limit_busy)

    def _scheduled_polls(self) -> list[tuple[Guard, float]]:
        """The guards looked at on a schedule, with when: the system rule's, and the cgroup
        guards that have a time set (the registrations' timetable, never all of them)."""
        found: list[tuple[Guard, float]] = [(g, self.examiner.next_system_poll)
                                            for g in self.rules.system_guards]
        found += [(g, g.due_at) for g in self.registrations.timed.values()
                  if g.present and g.due_at is not None]
        return found

    def _init_turns(self) -> None:
        """What the loop's turns are watched by. Called after every turn: heartbeat (systemd
        watchdog pings, metrics); the loop never sleeps longer than max_sleep, so a hung loop
        stops the pings and gets restarted. The park watchdog says why a turn is stale."""
        self.heartbeat: Callable[[], None] | None = None
        self.heartbeat_due: Callable[[float], float | None] | None = None  # seconds, or None
        self.max_sleep: float | None = None
        self.last_turn = self.clock()
        self._turn_began: float | None = None  # set while the loop is inside a turn
        self._acted = threading.Event()  # an action ended (set from the Actor's threads)
        self.park_watch = ParkWatchdog(self.log, self._park_reason, clock=self.clock)

    def _open_wakeups(self, poller: Callable[[], Any], files: CgroupFiles | None) -> None:
        """The loop's epoll (select.epoll's register/unregister/poll/close, or a test's fake)
        with its own wake-ups: the self-pipe (stop(), a reload, later marks, an action done)
        and the cgroup files' readiness."""
        self.epoll = poller()
        self._stopping = False
        self._wakeup = WakePipe()
        self.epoll.register(self._wakeup.fileno(), select.EPOLLIN)
        self.files = files if files is not None else CgroupFiles()
        files_fd = self.files.fileno()
        if files_fd is not None:
            self.epoll.register(files_fd, select.EPOLLIN)

    # -- set-up --------------------------------------------------------------------------------

    def arm(self) -> None:
        self.rules.warn(config_warnings(self.config, self.layout))
        self.upkeep.recover_store()
        self.upkeep.prune()
        if not self.files.available:
            self.log.info("guard.inotify_unavailable", reason=self.files.why,
                          explanation="limit changes and new cgroups are seen at each rescan "
                          f"(every {self.config.rescan_interval:g}s)")
        # Arm every guard before thawing what a dead run left stopped, and only then look at
        # the cgroups: a thawed victim over its threshold grows again at once, and must find
        # the guard in place rather than the OOM killer.
        self.settler.drop_changed_lifts()  # a limit set while no daemon ran is the cgroup's own
        self.guard_arming.examine_on_arm = False
        self.later_marks.hold()  # registered once the rest of the start is done
        try:
            self.rules.build_guards()
        finally:
            self.guard_arming.examine_on_arm = True
        try:
            self._take_over_standby()  # before the leftovers are continued: it may hold some
            self.cgroup_guards.put_back_leftovers()
            self.park_watch.start()
            self.starting = True  # a cgroup over its threshold keeps its leftovers stopped
            self.upkeep.thaw_leftovers()
            self.settler.settle()  # limits a dead run lifted for a dump's headroom, leftovers
            for guard in self.cgroup_guards.listed():
                if guard.present and guard.armed_limit is not None:
                    self.examine_cgroup(guard, self.clock(), source="arm")
            self.starting = False
            self.rescan.schedule()
            self.after_arming()
        finally:
            self.later_marks.release()

    def _take_over_standby(self) -> None:
        if self.standby is None:
            return
        previous = self.standby.take_over()
        if previous is not None:
            self.log.info("standby.taken_over", pid=previous,
                          explanation="the standby of the previous run ended; what it stopped "
                          "while no daemon ran is continued once the guards have acted on its "
                          "cgroup")

    def armed_count(self) -> int:
        """Guards armed now: the system rule's, and each present cgroup with a limit."""
        return sum(1 for guard in self.guards if isinstance(guard, SystemGuard)
                   or (guard.present and guard.armed_limit is not None))

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop())
        signal.signal(signal.SIGHUP, lambda signum, frame: self.request_reload())

    def request_reload(self) -> None:
        self._reload = True
        self._wakeup.wake(b"r")

    def reload(self) -> None:
        """SIGHUP, from the loop: the rules read again (rules.py); where they replace the
        running ones, the new guards are built and then settled as at start."""
        self._reload = False
        if self.rules.reload(release=self._release_guards, apply=self._apply_config):
            self.after_arming()

    def _apply_config(self, config: DaemonConfig) -> None:
        """A reload's config handed to the parts that read it as a value."""
        self.upkeep.config = config  # the store's budget as the new config says
        budget = self.checkpointer.budget  # shared with the control service: changed in place
        if budget is not None:
            budget.max_size, budget.keep_free = config.store_max_size, config.store_keep_free
            budget.max_age = config.store_max_age
        self._gpu_watching = self._wants_gpu_watch()
        self.actor.dry_run = self.armer.dry_run = config.dry_run

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.wake(b"x")

    def _release_guards(self) -> None:
        """Let actions in flight finish, then unregister every guard and put back what
        oomguard changed on its cgroup (memory.high, oom_kill_disable)."""
        self.actor.join()
        self.cgroup_guards.release()

    def close(self) -> None:
        if self.standby is not None:
            self.standby.bye()  # a clean stop: nothing to stand in for
        self._release_guards()
        if running_keepers():  # lazily restored jobs still need their lazy-pages daemons
            self.log.info("restore.lazy_waiting", keepers=running_keepers(),
                          explanation="waiting until the pages of lazily restored jobs are in")
            left = wait_for_keepers(LAZY_STOP_WAIT)
            if left:
                self.log.warning("restore.lazy_abandoned", keepers=left,
                                 explanation="pages still streaming in at exit")
        self.auto_resume.at_stop(resume=self.config.pageout_at_stop == "resume")
        self.park_watch.stop()
        self.files.close()
        self.newcomers.close()
        self.epoll.close()
        self._wakeup.close()

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            self.tick()

    def _timeout(self) -> float:
        """Until the first piece of work falls due (the epoll wait's timeout, in seconds)."""
        now = self.clock()
        waits = [wait for timer in self.timers if (wait := timer.due_in(now)) is not None]
        if self.max_sleep is not None:
            waits.append(self.max_sleep)
        beat = self.heartbeat_due(now) if self.heartbeat_due is not None else None
        if beat is not None:
            waits.append(beat)
        return max(0.0, min(waits)) if waits else -1.0

    def tick(self) -> None:
        ready = self.epoll.poll(self._timeout())
        woke = self._turn_began = self.clock()
        try:
            self._turn(ready, woke)
        finally:
            self._turn_began = None
        self.last_turn = self.clock()
        if self.heartbeat is not None:
            self.heartbeat()

    def _turn(self, ready: list[tuple[int, int]], woke: float) -> None:
        fired: list[Guard] = []
        files_ready = False
        for fd, _mask in ready:
            if fd == self._wakeup.fileno():
                self._wakeup.drain()
                continue
            if fd == self.files.fileno():
                files_ready = True
                continue
            owner = self.registrations.fd_owner.get(fd)
            if owner is None:
                continue
            guard, kind = owner
            events = consume(fd, kind)
            if kind == RECLAIM and isinstance(guard, CgroupGuard) \
                    and not self.examiner.reclaim_due(guard, events):
                continue  # reclaim, but not enough since the last look to reach the threshold
            if guard not in fired:
                fired.append(guard)
        if self._stopping:
            return
        if self._reload:
            self.reload()
            return
        for guard in fired:  # first: a crossing never waits behind bookkeeping
            self._examine(guard, woke, "event")
        if files_ready:
            self.cgroup_changes.apply_changes(self.files.read())
        for timer in self.timers:
            now = self.clock()
            wait = timer.due_in(now)
            if wait is not None and wait <= 0:
                timer.fire(now, fired)

    def action_done(self, name: str) -> None:
        """From an Actor thread: an action ended; the loop settles what it left (a lifted
        limit to put back, a store to prune) at once."""
        self._acted.set()
        self._wakeup.wake(b"a")

    def settle_soon(self) -> None:
        """From the control service's thread: a checkpoint asked for ended; settled at once
        as an action's end is (a limit it lifted and could not put back is acted on)."""
        self.action_done("control")

    # -- asked by others (the control service, the park watchdog, the GPU watch) --------------

    def summary(self, stored: list[CheckpointMeta] | None = None) -> str:
        """One line for systemd's STATUS=."""
        return summary_line(self.guards, self.upkeep.listed() if stored is None else stored)

    def status(self) -> dict[str, Any]:
        return {"daemon": True, "pid": self.self_pid, "dry_run": self.config.dry_run,
                "guards": guard_entries(self.guards, self.meminfo),
                "recent_events": list(getattr(self.log, "recent", []))}

    def _park_reason(self, name: str, waited: float) -> str:  # asked from the watchdog's thread
        now = self.clock()
        began = self._turn_began
        stuck = self.actor.busy(name) and now - self.actor.last_done.get(name, -1e9) >= waited
        return park_reason(now - began if began is not None else 0.0, STALE_TURN, stuck)

    def _wants_gpu_watch(self) -> bool:
        """NVML is read only while a rule has a GPU detection on and NVML works (decided at
        start and on each reload, not on every loop turn)."""
        return self.gpu_watch is not None and GpuWatch.wanted(self.gpu_watch.gpu,
                                                              self.config.guards)

    def protected_pids(self) -> frozenset[int]:
        """oomguard, what it runs, and its ancestors: never victims (selfguard.own_family)."""
        return own_family(self.proc, self.self_pid)

    def protected_among(self, processes: list[ProcessInfo]) -> frozenset[int]:
        """The daemon and what it started, among `processes`: cheap whatever the number of
        the daemon's own threads (one per control connection); its ancestors (a tree
        rooted at one holds the daemon); and the paged-out trees (stopped until they fit)."""
        return self.proc.descended_from(self.self_pid, processes) | ancestors_of(
            self.proc, self.self_pid) | self.auto_resume.held()
