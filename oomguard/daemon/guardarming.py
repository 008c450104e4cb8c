"""Arming cgroup guards from the loop: arming.py's Armer does the kernel's part, many guards at
once; here each armed guard is recorded, its limit file watched (inotify), registered with the
loop, reported, handed to the park watchdog and the standby, and looked at when it is over its
threshold already. A guard whose limit was written while it was being armed, or whose
memory.high another writer took back, is armed again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oomguard.cgroup import watch
from oomguard.config.loading import DaemonConfig
from oomguard.daemon.arming import Armer, LaterMarks, Prepared
from oomguard.daemon.cgroupguards import CgroupGuards
from oomguard.daemon.guardlines import guard_line
from oomguard.daemon.guards import CgroupGuard
from oomguard.daemon.registrations import Registrations
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.model.errors import CgroupGone
from oomguard.sense.cgroupfiles import CgroupFiles, stamp
from oomguard.store.ledger import SavedLimits

ARM_ROUNDS = 3  # a limit written while arming: armed again, at most this many times in all
# memory.high taken back more often than this within the window: given up to the other writer.
# A scheduler that writes it once per job or step, or an agent on a timer, is followed; one
# that writes its value back whenever it changes would fight oomguard for ever, both writing
# as fast as inotify wakes them.
HIGH_TAKEBACKS_FOLLOWED = 20
HIGH_TAKEBACK_WINDOW = 30.0


def recent_takebacks(before: tuple[float, ...], now: float,
                     window: float = HIGH_TAKEBACK_WINDOW) -> tuple[float, ...]:
    """The take-backs within `window` of `now`, this one (`now`) last."""
    return (*(at for at in before if now - at < window), now)


class GuardArming:
    """Arms the Daemon's cgroup guards (oomguard/daemon/cgroupguards.py). Owns whether a guard
    is looked at as soon as it is armed (`examine_on_arm`: False while the daemon's arm() builds
    the guards at start). What it reads of the Daemon that can change (the config after a
    reload) it reads through a callable; the park watchdog and the standby, as the cgroup guards
    do."""

    def __init__(self, *, guards: CgroupGuards, registrations: Registrations, armer: Armer,
                 later_marks: LaterMarks, files: CgroupFiles, checkpointer: Checkpointer,
                 saved_high: SavedLimits, log: Any, clock: Callable[[], float],
                 config: Callable[[], DaemonConfig],
                 examine_cgroup: Callable[[CgroupGuard, float, str], None]) -> None:
        self.guards = guards
        self.registrations = registrations
        self.armer = armer
        self.later_marks = later_marks
        self.files = files
        self.checkpointer = checkpointer
        self.saved_high = saved_high
        self.log = log
        self.clock = clock
        self._config = config
        self._examine_cgroup = examine_cgroup
        self.examine_on_arm = True

    @property
    def config(self) -> DaemonConfig:
        return self._config()

    def arm(self, guards: list[CgroupGuard]) -> None:
        """Arm these guards together (concurrently: see arming.py), then register and report
        each, and look at each that is over its threshold already; their marks beyond the
        threshold follow from beside the loop (add_later_marks)."""
        if not guards:  # a rescan that found nothing: the directories watched stand
            return
        armed: list[Prepared] = []
        round_ = 0
        while guards:  # (a memory.high taken back again and again is yielded: it ends)
            for guard in guards:
                self.registrations.disarm(guard)
            last = round_ >= ARM_ROUNDS - 1
            again = []
            for prepared in self.armer.arm(guards):
                if self._finish_arming(prepared, recheck=not last):
                    again.append(prepared.guard)
                elif prepared.guard.fds:
                    armed.append(prepared)
            guards = again
            round_ += 1
        self.later_marks.start(armed)
        self.guards.watch_directories()  # where the missing would appear, beside the present

    def _finish_arming(self, prepared: Prepared, recheck: bool = True) -> bool:
        """Register and report one armed guard. True (nothing registered: arm it again) when
        `recheck` and its limit was written while it was being armed, after the read and
        before the inotify watch (a job scheduler sets the limit of a cgroup it has just
        made): no event would tell, and the file's stamp already has the write in it. The
        same for a memory.high taken back meanwhile, in every round: a guard armed over one
        would be woken only at the limit (bounded: past HIGH_TAKEBACKS_FOLLOWED it is
        yielded, and no longer taken back)."""
        guard, snap = prepared.guard, prepared.snapshot
        if snap is None:
            if guard.present:
                self.log.warning("guard.cgroup_missing", cgroup=guard.name)
            guard.present = False
            guard.limit_stamp = None
            return False
        guard.present = True
        guard.armed_limit = snap.limit_bytes
        guard.oom_kills = snap.oom_kills
        guard.last_snapshot = snap
        guard.limit_stamp = stamp(guard.cgroup.path / guard.cgroup.limit_file)
        self.files.watch_limit(guard.name, guard.cgroup.path / guard.cgroup.limit_file)
        setting = watch.replaced_setting_file(guard)
        if setting is None:
            self.files.unwatch_setting(guard.name)
        else:
            self.files.watch_setting(guard.name, setting)
        if (recheck and self._limit_moved(guard, snap.limit_bytes)) or self.high_taken(guard):
            return True
        if snap.limit_bytes is None:
            guard.detection = "none (no memory limit)"
        else:
            if prepared.error is not None:
                self.log.warning("guard.events_unavailable", cgroup=guard.name,
                                 error=prepared.error)
                self.registrations.disarm(guard)
            if not guard.fds:
                guard.detection = ""
            # v2 reports no usage crossings by itself: without memory.high it is polled.
            guard.poll_only = not guard.fds or not watch.reports_crossings(guard)
            if guard.poll_only:
                polled = f"polling every {self.config.poll_interval * 1000:.0f}ms"
                guard.detection = f"{guard.detection} + {polled}" if guard.fds else polled
                self.registrations.set_due(guard, self.clock())
            self.registrations.register(guard)
            parking = watch.parks_at_limit(guard)
            if parking is not None:
                self.guards.park_watch.watch(guard.name, parking, guard.spec.park_deadline)
                standby = self.guards.standby
                if standby is not None:  # stops it at the threshold while no daemon runs
                    standby.tell(guard.name, int(snap.limit_bytes * guard.spec.threshold),
                                 str(parking.mount), guard.spec.park_deadline)
        self.log.info("guard.armed", cgroup=guard.name, cgroup_version=guard.cgroup.version,
                      detection=guard.detection, limit=snap.limit_bytes,
                      threshold=guard.spec.threshold, usage=snap.usage_bytes,
                      summary=guard_line(guard, snap.limit_bytes, dry_run=self.config.dry_run))
        # Already over the threshold when armed: no crossing will come, look now.
        if self.examine_on_arm and snap.limit_bytes is not None:
            self._examine_cgroup(guard, self.clock(), "arm")
        return False
    def _limit_moved(self, guard: CgroupGuard, armed: int | None) -> bool:
        """Whether the guard's limit file now says other than `armed` (one read; a limit
        oomguard lifted for a dump's headroom does not count)."""
        if self.checkpointer.limit_lifted(guard.cgroup.path):
            return False
        try:
            return guard.cgroup.limit() != armed
        except (CgroupGone, OSError):
            return False  # gone: the directory watch and the rescan say so

    def high_taken(self, guard: CgroupGuard) -> bool:
        """Whether another writer raised the memory.high oomguard set at the guard's threshold
        (then the kernel would throttle and wake oomguard only at the limit): said, and its
        value made the one to put back, for arming to set it at the threshold again. Not while
        oomguard itself has lifted it for a dump."""
        if guard.armed_limit is None or self.checkpointer.limit_lifted(guard.cgroup.path):
            return False
        found = watch.high_taken_back(guard, guard.armed_limit)
        if found is None:
            return False
        guard.high_takebacks = recent_takebacks(guard.high_takebacks, self.clock())
        self.saved_high.forget(watch.saved_key(guard))
        if len(guard.high_takebacks) > HIGH_TAKEBACKS_FOLLOWED:
            self._yield_high(guard, found)
            return True
        self.log.warning("guard.high_taken_back", cgroup=guard.name, memory_high=found,
                         threshold_bytes=int(guard.armed_limit * guard.spec.threshold),
                         explanation="another writer (a job scheduler, systemd's MemoryHigh=) "
                         "set memory.high above the guard's threshold, where the kernel would "
                         "wake oomguard only at the limit: set at the threshold again; theirs "
                         "is what oomguard puts back when it lets go")
        return True

    def _yield_high(self, guard: CgroupGuard, found: int) -> None:
        watch.yield_high(guard)
        window = HIGH_TAKEBACK_WINDOW
        self.log.warning(
            "guard.high_yielded", cgroup=guard.name, memory_high=found,
            takebacks=len(guard.high_takebacks), window_s=window,
            poll_interval_s=self.config.poll_interval,
            explanation=f"another writer took memory.high back {len(guard.high_takebacks)} "
            f"times in {window:.0f} s: oomguard no longer sets it, so as not to fight it; "
            "theirs stands, and the guard polls the cgroup's usage instead (until the cgroup "
            "is made anew or the daemon restarts)")
