"""The guard loop: kernel notifications in, decisions out, one checkpoint at a time.

Sleeps in epoll until a watched fd fires (v1 usage thresholds and OOM events, v2 memory.high /
memory.events changes, PSI triggers), a signal arrives, or the rescan interval passes. Polls
only where notifications cannot tell a crossing (v2 without memory.high, pages of cache above
the threshold, system-wide MemAvailable as it nears the floor).
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from oomguard.acting import Actor, Request, rule_parts
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot, subtree_procs
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.chain import ChainRunner
from oomguard.checkpoint import Checkpointer
from oomguard.config import DaemonConfig, check_config, config_warnings, load_config
from oomguard.decisionlog import DecisionLog
from oomguard.errors import CgroupGone, ConfigError, ConfigIssue, ProcessGone
from oomguard.gpuwatch import GpuWatch
from oomguard.guards import (
    EPOLL_MASK,
    CgroupGuard,
    Guard,
    SystemGuard,
    arm_system,
    arm_v1,
    arm_v2,
    claimed_keys,
    consume,
    disable_oom_kill,
    psi_trigger_for,
    put_back_high,
    put_back_leftovers,
    put_back_oom_kill,
    set_high_at_threshold,
)
from oomguard.guardstatus import guard_entries, summary_line
from oomguard.keeper import StoreKeeper
from oomguard.kubelet import ContainerCheckpointer
from oomguard.ledger import SavedLimits
from oomguard.parkwatch import ParkWatchdog, park_reason
from oomguard.policy import (
    ProcessTree,
    Verdict,
    below_min_available,
    build_trees,
    evaluate,
    rank_victims,
    system_candidates,
    with_vram,
)
from oomguard.prediction import forecast
from oomguard.procfs import ProcessInfo, ProcReader
from oomguard.psi import parse_pressure
from oomguard.restore import Restorer
from oomguard.selfguard import ancestors_of, own_family
from oomguard.startup import guard_line
from oomguard.store import CheckpointMeta
from oomguard.systemrule import floor_reason, in_cgroups, next_poll, pressure_reason

SAVED_HIGH = ".memory-high.json"
STALE_LOOP_TURNS = 3  # the loop turns at least every rescan_interval; 3 missed: it is wedged


class Daemon:
    def __init__(self, config: DaemonConfig, checkpointer: Checkpointer, layout: CgroupLayout,
                 log: Any, *, proc: ProcReader | None = None,
                 clock: Callable[[], float] = time.monotonic, self_pid: int | None = None,
                 meminfo: Callable[[], Any] = psutil.virtual_memory,
                 restorer: Restorer | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 containers: ContainerCheckpointer | None = None) -> None:
        self.config = config
        self.checkpointer = checkpointer
        self.layout = layout
        self.log = log
        self.proc = proc or ProcReader()
        self.clock = clock
        self.self_pid = self_pid if self_pid is not None else os.getpid()
        self.meminfo = meminfo
        self.guards: list[Guard] = []
        self.epoll = select.epoll()
        self._fd_owner: dict[int, tuple[Guard, str]] = {}
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.epoll.register(self._wake_r, select.EPOLLIN)
        self._next_rescan = 0.0
        self._next_system_poll = 0.0
        self.saved_high = SavedLimits(config.store / SAVED_HIGH)
        self.psi_trigger = psi_trigger_for()
        self.decisions = DecisionLog(clock)  # a dry run says a lasting decision once
        self.keeper = StoreKeeper(checkpointer.store, checkpointer.ledger, config, self.log,
                                  restorer=restorer, clock=clock, wall_clock=wall_clock)
        self.actor = Actor(ChainRunner(checkpointer, checkpointer.freezer, self.proc, self.log,
                                       clock=clock, containers=containers),
                           self.log, dry_run=config.dry_run, on_checkpoint=self._after_dump,
                           clock=clock, decisions=self.decisions)
        self._reload = False
        self._globs: list[tuple[Any, str]] = []
        # Called after every loop turn (systemd watchdog pings, metrics); the loop never
        # sleeps longer than max_sleep, so a hung loop stops the pings and gets restarted.
        self.heartbeat: Callable[[], None] | None = None
        self.max_sleep: float | None = None
        self._examine_on_arm = True  # False while arm() builds the guards at start
        self._limit_busy: set[str] = set()  # cgroups whose lifted limit could not be put back yet
        self.gpu_watch = GpuWatch(checkpointer.gpu, config.gpu.poll_interval, self.actor,
                                  self.proc, self.log, protected=self.protected_pids,
                                  in_cgroups=self._in_cgroups, cgroup_of=self._cgroup_of,
                                  clock=clock) if checkpointer.gpu is not None else None
        self._gpu_watching = self._wants_gpu_watch()
        self.last_turn = clock()
        self.park_watch = ParkWatchdog(self.log, self._park_reason, clock=clock)

    # -- set-up --------------------------------------------------------------------------------

    def arm(self) -> None:
        self._warn_config(config_warnings(self.config, self.layout))
        self.keeper.recover_store()
        self.keeper.prune()
        # Arm every guard before thawing what a dead run left stopped, and only then look at
        # the cgroups: a thawed victim over its threshold grows again at once, and must find
        # the guard in place rather than the OOM killer.
        self._examine_on_arm = False
        try:
            self._build_guards()
        finally:
            self._examine_on_arm = True
        self._put_back_leftovers()
        self.park_watch.start()
        self.keeper.thaw_leftovers()
        self._settle_lifts()  # limits a dead run lifted for a dump's headroom
        for guard in self.guards:
            if isinstance(guard, CgroupGuard) and guard.present and guard.armed_limit is not None:
                self._examine_cgroup(guard, self.clock(), source="arm")
        self._next_rescan = self.clock() + self.config.rescan_interval

    def _build_guards(self) -> None:
        for spec in self.config.guards:
            if spec.system:
                system = SystemGuard(spec=spec)
                system.parts = rule_parts(spec)
                self.guards.append(system)
                arm_system(system, self.psi_trigger)
                self._register(system)
                self.log.info("guard.armed", cgroup="system", detection=system.detection,
                              min_available=spec.min_available,
                              summary=guard_line(system, None, self.meminfo().total,
                                                 self.config.dry_run))
                continue
            for path in spec.cgroups:
                if glob.has_magic(path):
                    self._globs.append((spec, path))
                    continue
                self._add_cgroup_guard(spec, path)
        self._expand_globs()

    def _add_cgroup_guard(self, spec: Any, path: str, pattern: str = "") -> None:
        guard = CgroupGuard(spec=spec, cgroup=open_cgroup(path, self.layout), pattern=pattern)
        guard.parts = rule_parts(spec)
        self.guards.append(guard)
        self._arm_cgroup(guard)

    def _expand_globs(self) -> None:
        """Rules may name cgroups by glob (`/slurm/uid_*/job_*`): guard each that exists now,
        drop the ones that went away."""
        mount = self.layout.memory_mount
        for spec, pattern in self._globs:
            fs_pattern = pattern if mount is None or pattern.startswith(str(mount)) else \
                str(mount) + "/" + pattern.lstrip("/")
            known = {g.name for g in self.guards if isinstance(g, CgroupGuard)}
            for match in sorted(glob.glob(fs_pattern)):
                if match not in known and os.path.isdir(match):
                    self._add_cgroup_guard(spec, match, pattern)
        for guard in list(self.guards):
            if isinstance(guard, CgroupGuard) and guard.pattern and not guard.cgroup.exists():
                self._cgroup_gone(guard)
                self.guards.remove(guard)

    def _register(self, guard: Guard) -> None:
        for fd, kind in guard.fds.items():
            self.epoll.register(fd, EPOLL_MASK[kind])
            self._fd_owner[fd] = (guard, kind)

    def _arm_cgroup(self, guard: CgroupGuard) -> None:
        self._disarm(guard)
        try:
            snap = self.checkpointer.own_snapshot(guard.cgroup)  # never a limit we lifted
        except CgroupGone:
            if guard.present:
                self.log.warning("guard.cgroup_missing", cgroup=guard.name)
            guard.present = False
            return
        guard.present = True
        guard.armed_limit = snap.limit_bytes
        guard.oom_kills = snap.oom_kills
        guard.detection = "none (no memory limit)"
        if snap.limit_bytes is not None:
            try:
                if guard.spec.events and isinstance(guard.cgroup, V1MemoryCgroup):
                    arm_v1(guard, snap.limit_bytes)
                    self._park_at_limit(guard, guard.cgroup)
                elif guard.spec.events and isinstance(guard.cgroup, V2MemoryCgroup):
                    set_high_at_threshold(guard, guard.cgroup, snap.limit_bytes, self.saved_high)
                    arm_v2(guard, snap.limit_bytes, self.psi_trigger)
            except (OSError, CgroupGone) as exc:
                self.log.warning("guard.events_unavailable", cgroup=guard.name, error=str(exc))
                self._disarm(guard)
            # v2 reports no usage crossings by itself: without memory.high it is polled.
            guard.poll_only = not guard.fds or (
                isinstance(guard.cgroup, V2MemoryCgroup) and not guard.high_set)
            if guard.poll_only:
                polled = f"polling every {self.config.poll_interval * 1000:.0f}ms"
                guard.detection = f"{guard.detection} + {polled}" if guard.fds else polled
            self._register(guard)
        self.log.info("guard.armed", cgroup=guard.name, cgroup_version=guard.cgroup.version,
                      detection=guard.detection, limit=snap.limit_bytes,
                      threshold=guard.spec.threshold, usage=snap.usage_bytes,
                      summary=guard_line(guard, snap.limit_bytes, dry_run=self.config.dry_run))
        # Already over the threshold when armed: no crossing will come, look now.
        if self._examine_on_arm:
            self._examine_cgroup(guard, self.clock(), source="arm")

    def _disarm(self, guard: Guard) -> None:
        for fd in guard.fds:
            with contextlib.suppress(OSError):
                self.epoll.unregister(fd)
            self._fd_owner.pop(fd, None)
            with contextlib.suppress(OSError):
                os.close(fd)
        guard.fds.clear()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop())
        signal.signal(signal.SIGHUP, lambda signum, frame: self.request_reload())

    def request_reload(self) -> None:
        self._reload = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"r")

    def reload(self) -> None:
        """SIGHUP: read the config file again. A config with any error is rejected, every error
        logged, and the running rules stay; a good one replaces the rules."""
        self._reload = False
        source = self.config.source
        if not os.path.isfile(source):
            self.log.warning("config.reload_ignored", source=source,
                             explanation="rules came from the command line, not a file")
            return
        try:
            new = load_config(source)
            warnings = check_config(new, self.layout)
        except ConfigError as exc:
            issues = [str(i) for i in exc.issues]
            self.log.error("config.rejected", source=source, issues=issues,
                           explanation="the running rules stay in force")
            return
        for key in ("store", "socket", "criu"):
            if getattr(new, key) != getattr(self.config, key):
                self.log.warning("config.restart_needed", key=f"daemon.{key}",
                                 explanation="this setting takes effect at the next start")
        self._warn_config(warnings)
        self._release_guards()
        self.guards = []
        self._globs = []
        self.config = replace(new, store=self.config.store, socket=self.config.socket,
                              criu=self.config.criu)
        self._gpu_watching = self._wants_gpu_watch()
        self.actor.dry_run = self.config.dry_run
        self.log.info("config.reloaded", source=source, guards=len(new.guards))
        self._build_guards()

    def _warn_config(self, warnings: list[ConfigIssue]) -> None:
        """What check-config prints as warnings: the rules run, the mistake is logged."""
        for issue in warnings:
            self.log.warning("config.warning", source=issue.source, key=issue.key,
                             reason=issue.reason)

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _release_guards(self) -> None:
        """Let actions in flight finish, then unregister every guard and put back what
        oomguard changed on its cgroup (memory.high, oom_kill_disable)."""
        self.actor.join()
        for guard in self.guards:
            self._disarm(guard)
            if isinstance(guard, CgroupGuard):
                self._put_back(guard)

    def _put_back(self, guard: CgroupGuard) -> None:
        put_back_high(guard, self.saved_high)
        self.park_watch.unwatch(guard.name)  # before: the watchdog must not write after it
        put_back_oom_kill(guard, self.saved_high)

    def close(self) -> None:
        self._release_guards()
        self.park_watch.stop()
        self.epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            self.tick()

    def _timeout(self) -> float:
        now = self.clock()
        timeout = max(0.0, self._next_rescan - now)
        if self.max_sleep is not None:
            timeout = min(timeout, self.max_sleep)
        if self._gpu_watching:
            assert self.gpu_watch is not None
            timeout = min(timeout, self.gpu_watch.due_in(now))
        for guard in self.guards:
            if isinstance(guard, SystemGuard):
                timeout = min(timeout, max(0.0, self._next_system_poll - now))
            elif guard.present and guard.armed_limit is not None and (
                    guard.poll_only or guard.watching or guard.predicting):
                timeout = min(timeout, self.config.poll_interval)
        return timeout

    def tick(self) -> None:
        ready = self.epoll.poll(self._timeout())
        woke = self.clock()
        fired: list[Guard] = []
        for fd, _mask in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 64)
                continue
            owner = self._fd_owner.get(fd)
            if owner is None:
                continue
            guard, kind = owner
            consume(fd, kind)
            if guard not in fired:
                fired.append(guard)
        if self._stopping:
            return
        if self._reload:
            self.reload()
            return
        for guard in fired:
            self._examine(guard, woke, "event")
        now = self.clock()
        for guard in self.guards:
            if guard in fired:
                continue
            if isinstance(guard, SystemGuard):
                if now >= self._next_system_poll:
                    self._examine(guard, now, "poll")
            elif guard.present and (guard.poll_only or guard.watching or guard.predicting):
                self._examine(guard, now, "poll")
        if self._gpu_watching:
            assert self.gpu_watch is not None
            self.gpu_watch.tick(self.guards)
        if self.clock() >= self._next_rescan:
            self._rescan()
            self._next_rescan = self.clock() + self.config.rescan_interval
        self.last_turn = self.clock()
        if self.heartbeat is not None:
            self.heartbeat()

    def _examine(self, guard: Guard, woke: float, source: str) -> None:
        if isinstance(guard, SystemGuard):
            self._examine_system(guard, woke, source)
        else:
            self._examine_cgroup(guard, woke, source)

    def _rescan(self) -> None:
        if self._globs:
            self._expand_globs()
        for guard in self.guards:
            if not isinstance(guard, CgroupGuard):
                continue
            try:
                snap = guard.cgroup.snapshot()
            except CgroupGone:
                self._cgroup_gone(guard)
                continue
            guard.last_snapshot = snap
            lifted = self.checkpointer.limit_lifted(guard.cgroup.path)  # headroom, not theirs
            if not guard.present or (snap.limit_bytes != guard.armed_limit and not lifted):
                self._arm_cgroup(guard)
            self._note_oom_kills(guard, snap)
            if snap.under_oom:  # a task parked at the limit (oom_kill_disable) must not wait on
                self._examine_cgroup(guard, self.clock(), "rescan")
            if guard.spec.auto_restore and guard.present:
                self.keeper.consider_restore(guard, snap)
        if self.checkpointer.lifts.pending() or self._limit_busy:
            self._settle_lifts()
        self.keeper.tick()

    def _park_at_limit(self, guard: CgroupGuard, cgroup: V1MemoryCgroup) -> None:
        """v1: tasks at the limit wait for oomguard (oom_kill_disable), under the watchdog's
        deadline unless the user had set it already. Not in a dry run: nothing would act."""
        if self.config.dry_run:
            return
        disable_oom_kill(guard, cgroup, self.saved_high)
        if guard.oom_disable_changed and not guard.oom_disable_original:
            self.park_watch.watch(guard.name, cgroup, guard.spec.park_deadline)

    def _put_back_leftovers(self) -> None:
        """What a dead run changed on cgroups that no rule now changes the same way."""
        armed = [g for g in self.guards if isinstance(g, CgroupGuard)]
        for cgroup, setting in put_back_leftovers(
                self.saved_high, claimed_keys(armed),
                lambda path: open_cgroup(path, self.layout)):
            self.log.info("guard.setting_restored", cgroup=cgroup, setting=setting,
                          explanation="put back after a previous run that did not stop cleanly")
        for pid in self.checkpointer.shield.recover():
            self.log.info("guard.setting_restored", pid=pid, setting="oom_score_adj",
                          explanation="put back after a previous run that did not stop cleanly")

    def _park_reason(self, name: str, waited: float) -> str:  # asked from the watchdog's thread
        now = self.clock()
        stuck = self.actor.busy(name) and now - self.actor.last_done.get(name, -1e9) >= waited
        return park_reason(now - self.last_turn, STALE_LOOP_TURNS * self.config.rescan_interval,
                           stuck)

    def _settle_lifts(self) -> None:
        """Put back the limits lifted for dumps that no live oomguard needs lifted any more. One
        that cannot be put back (something grew into the lifted room) is retried on every
        rescan, and its guard acts on the grower at once: the limit comes back, never stays."""
        def cgroup_at(path: str) -> MemoryCgroup | None:
            try:
                return open_cgroup(path, self.layout)
            except ValueError:
                return None

        for path in sorted(self._limit_busy):
            if not self.checkpointer.lifts.lifted(Path(path)):  # put back by a later dump
                self._limit_busy.discard(path)
                self.log.info("limit.restored", cgroup=path,
                              explanation="the limit lifted for a dump's headroom is back")
        for settled in self.checkpointer.lifts.settle(cgroup_at):
            if settled.outcome == "restored":
                self.log.info("limit.restored", cgroup=settled.path,
                              explanation="the limit lifted for a dump's headroom is back")
                self._limit_busy.discard(settled.path)
            elif settled.outcome == "busy":
                if settled.path not in self._limit_busy:
                    self._limit_busy.add(settled.path)
                    self.log.error("limit.restore_failed", cgroup=settled.path,
                                   error=settled.detail, explanation="the cgroup grew into the "
                                   "room lifted for a dump; acting on it until the limit is back")
                for guard in self.guards:
                    if isinstance(guard, CgroupGuard) and guard.present \
                            and str(guard.cgroup.path) == settled.path:
                        self._examine_cgroup(guard, self.clock(), "limit-restore")

    def _cgroup_gone(self, guard: CgroupGuard) -> None:
        if guard.present:
            self.log.warning("guard.cgroup_gone", cgroup=guard.name)
            self._disarm(guard)
            self._put_back(guard)  # the cgroup is gone: only forgets
            guard.present = False

    def _note_oom_kills(self, guard: CgroupGuard, snap: MemorySnapshot) -> None:
        if snap.oom_kills > guard.oom_kills:
            self.log.error("oom.kill_seen", cgroup=guard.name,
                           kills=snap.oom_kills - guard.oom_kills,
                           explanation="the kernel OOM killer acted before oomguard could")
        guard.oom_kills = snap.oom_kills

    def summary(self, stored: list[CheckpointMeta] | None = None) -> str:
        """One line for systemd's STATUS=."""
        return summary_line(self.guards, self.keeper.store.list() if stored is None else stored)

    def status(self) -> dict[str, Any]:
        return {"daemon": True, "pid": self.self_pid, "dry_run": self.config.dry_run,
                "guards": guard_entries(self.guards, self.meminfo),
                "recent_events": list(getattr(self.log, "recent", []))}

    # -- cgroup rules --------------------------------------------------------------------------

    def _examine_cgroup(self, guard: CgroupGuard, woke: float, source: str) -> None:
        try:
            snap = self.checkpointer.own_snapshot(guard.cgroup)  # never a limit we lifted
        except CgroupGone:
            self._cgroup_gone(guard)
            return
        self._note_oom_kills(guard, snap)
        decision = evaluate(snap, guard.spec.threshold)
        watching = decision.verdict is Verdict.WATCH
        if watching and not guard.watching:
            self.log.info("threshold.cache_only", cgroup=guard.name, source=source,
                          usage=snap.usage_bytes, anon=snap.anon_bytes, limit=snap.limit_bytes,
                          explanation="usage is over the threshold in reclaimable page cache; "
                          "polling until it drops")
        guard.watching = watching
        reason = decision.reason
        if decision.verdict is not Verdict.ACT:
            predicted = self._predict(guard, snap)
            if predicted is None:
                self.decisions.forget(guard.name)
                return
            reason = predicted
        else:
            guard.samples.clear()
        if self.actor.busy(guard.name):
            return
        since = self.clock() - self.actor.last_done.get(guard.name, -1e9)
        if since < guard.spec.post_action_delay:
            return
        self._say_crossed(guard.name, source=source, usage=snap.usage_bytes,
                          anon=snap.anon_bytes, resident=snap.unreclaimable_bytes,
                          limit=snap.limit_bytes, reason=reason)
        cgroup = guard.cgroup
        threshold = guard.spec.threshold
        floor = int((snap.limit_bytes or 0) * min(threshold, guard.spec.predict_from)) \
            if decision.verdict is not Verdict.ACT else 0

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
            return rank_victims(with_vram(build_trees(members, self.protected_among(members)),
                                          self._vram()))

        assert guard.parts is not None
        freeze = cgroup if (guard.spec.freeze_cgroup and isinstance(cgroup, V2MemoryCgroup)
                            and decision.verdict is Verdict.ACT) else None
        self.actor.start(Request(guard.name, guard.parts, woke, reason, candidates,
                                 lambda tree: cgroup, still_pressing, freeze))

    def _say_crossed(self, name: str, **fields: Any) -> None:
        """threshold.crossed; in a dry run, where nothing ends the condition, once (then
        once a minute) until the condition is over."""
        if self.config.dry_run and self.decisions.due(name, "crossed", True) is None:
            return
        self.log.warning("threshold.crossed", cgroup=name, **fields)

    def _predict(self, guard: CgroupGuard, snap: MemorySnapshot) -> str | None:
        """Time-to-limit: over `predict_from` of the limit, keep recent usage samples and act
        when, at the current growth, the limit comes before a checkpoint could finish."""
        limit = snap.limit_bytes
        if not guard.spec.time_to_limit or limit is None:
            return None
        guard.predicting = snap.usage_bytes >= limit * guard.spec.predict_from
        if not guard.predicting:
            guard.samples.clear()
            return None
        guard.samples.append((self.clock(), snap.usage_bytes))
        outlook = forecast(list(guard.samples), limit, snap.anon_bytes, self.keeper.throughput)
        if outlook is None or not outlook.act:
            return None
        guard.samples.clear()
        return outlook.reason()

    def _after_dump(self, image_bytes: int, dump_seconds: float) -> None:
        self.keeper.note_dump(image_bytes, dump_seconds)
        self.keeper.prune()

    def _wants_gpu_watch(self) -> bool:
        """NVML is read only while a rule has a gpu_threshold and NVML works (decided at
        start and on each reload, not on every loop turn)."""
        return self.gpu_watch is not None and GpuWatch.wanted(self.gpu_watch.gpu,
                                                              self.config.guards)

    def _vram(self) -> dict[int, int]:
        gpu = self.checkpointer.gpu
        return gpu.vram_by_pid() if gpu is not None and gpu.accounting else {}

    def user_headroom(self, cgroup: MemoryCgroup) -> int:
        """Headroom for a non-root user's on-demand checkpoint in `cgroup`: only where its
        rule says `user_headroom = true`."""
        for guard in self.guards:
            if isinstance(guard, CgroupGuard) and guard.cgroup.path == cgroup.path:
                return guard.spec.headroom if guard.spec.user_headroom else 0
        return 0

    def protected_pids(self) -> frozenset[int]:
        """oomguard, what it runs, and its ancestors: never victims (selfguard.own_family)."""
        return own_family(self.proc, self.self_pid)

    def protected_among(self, processes: list[ProcessInfo]) -> frozenset[int]:
        """The daemon and what it started, among `processes`: cheap whatever the number of
        the daemon's own threads (one per control connection); and its ancestors (a tree
        rooted at one holds the daemon)."""
        return self.proc.descended_from(self.self_pid, processes) | ancestors_of(
            self.proc, self.self_pid)

    # -- system-wide rules --------------------------------------------------------------------

    def _examine_system(self, guard: SystemGuard, woke: float, source: str) -> None:
        memory = self.meminfo()
        floor = guard.spec.min_available
        self._next_system_poll = self.clock() + next_poll(
            memory.available, memory.total, floor, self.config.poll_interval)
        if below_min_available(memory.available, memory.total, floor):
            reason = floor_reason(memory.available, floor)
        else:
            pressed = pressure_reason(self._full_avg10(), guard.spec.psi_full_avg10)
            if pressed is None:
                self.decisions.forget(guard.name)
                return
            reason = pressed
        if self.actor.busy(guard.name):
            return
        if self.clock() - self.actor.last_done.get(guard.name, -1e9) < guard.spec.post_action_delay:
            return
        self._say_crossed(guard.name, source=source, available=memory.available,
                          total=memory.total, reason=reason)

        def candidates() -> list[ProcessTree]:
            processes = self.proc.processes(self.proc.all_pids())
            if guard.spec.victim_cgroups:
                processes = [p for p in processes
                             if self._in_cgroups(p.pid, guard.spec.victim_cgroups)]
            return rank_victims(with_vram(system_candidates(processes,
                                                            self.protected_among(processes)),
                                          self._vram()))

        def still_pressing() -> bool:
            now = self.meminfo()
            return below_min_available(now.available, now.total, floor) or pressure_reason(
                self._full_avg10(), guard.spec.psi_full_avg10) is not None

        assert guard.parts is not None
        self.actor.start(Request(guard.name, guard.parts, woke, reason, candidates,
                                 self._cgroup_of, still_pressing))
        self._next_system_poll = self.clock()

    def _full_avg10(self) -> float:
        try:
            pressure = parse_pressure(Path("/proc/pressure/memory").read_text())
        except (OSError, ValueError):
            return 0.0
        return pressure.full.avg10 if pressure.full is not None else 0.0

    def _in_cgroups(self, pid: int, roots: tuple[str, ...]) -> bool:
        try:
            rel = self.proc.memory_cgroup(pid) or "/"
        except ProcessGone:
            return False
        return in_cgroups(rel, str(self.layout.memory_mount or ""), roots)

    def _cgroup_of(self, tree: ProcessTree) -> MemoryCgroup | None:
        try:
            rel = self.proc.memory_cgroup(tree.root.pid)
            return open_cgroup(rel, self.layout) if rel and self.layout.memory_mount else None
        except (ProcessGone, ValueError):
            return None
