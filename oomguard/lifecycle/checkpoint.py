"""Freeze -> headroom -> dump -> durable -> free: one checkpoint of one process tree.

On any failure the tree is thawed and keeps running, and the raised CheckpointFailed says so
and why (a rule's kill after a failed checkpoint is its action chain's next step: chain.py).
A process is never left stopped, and one the user had stopped is never continued (meta.json
names it: restore leaves it stopped too).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from oomguard.act.bystanders import Bystanders, Held
from oomguard.act.criu import Criu, format_version
from oomguard.act.freezer import USER_STOPPED_STATE, Freezer, Frozen, SigstopFreezer
from oomguard.act.lifts import LimitLifts
from oomguard.act.oomshield import OomShield
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.watch import shields_needed
from oomguard.gpu.offload import GpuHold, GpuRefused, back_to_gpu, move_off_gpu, put_back_limit
from oomguard.gpu.runtime import GpuSupport
from oomguard.lifecycle import fileids
from oomguard.lifecycle.fileids import FILES_RECORD
from oomguard.lifecycle.jobroot import refuse_partial_job
from oomguard.lifecycle.selfguard import refuse_own_tree
from oomguard.model.errors import (
    CgroupGone,
    CheckpointFailed,
    CriuError,
    FailedCheckpoint,
    ProcessGone,
    StoreError,
    StoreOverBudget,
    TreeNotYours,
)
from oomguard.policy.budget import BudgetReading, image_estimate
from oomguard.policy.jobs import job_fields
from oomguard.policy.pressure import headroom_needed
from oomguard.policy.retention import Prune
from oomguard.policy.rights import foreign_of
from oomguard.policy.unfit import lasting_failure
from oomguard.policy.victims import ProcessTree
from oomguard.sense.owners import owner_fields
from oomguard.sense.procfs import ProcReader
from oomguard.store.budget import BudgetExceeded, Reservation, StoreBudget
from oomguard.store.checkpoints import CheckpointMeta, Store, new_id
from oomguard.store.compression import Packer
from oomguard.store.digest import ImageDigester, with_packed
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import FROZEN_LEDGER, HOOKS_DIR, LIFTS_LEDGER, OOM_SHIELD
from oomguard.terminal.checkpointing import DumpTerminals, terminal_refusal

DUMP_SLOTS = 2
FULL_DISK = 1 << 20  # a failed dump that left less room than this on the store's disk ran out
OUTCOME_UNTOUCHED = FailedCheckpoint.UNTOUCHED  # refused before the process was stopped
OUTCOME_INCOMPLETE = FailedCheckpoint.INCOMPLETE  # gone, images intact, commit to be finished


@dataclass(frozen=True)
class CheckpointTimings:
    freeze_s: float
    dump_s: float
    commit_s: float
    total_s: float
    holders_s: float = 0.0  # of dump_s: waiting for terminal holders to answer `dumping`


@dataclass(frozen=True)
class CheckpointResult:
    meta: CheckpointMeta
    path: Path
    timings: CheckpointTimings


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class Checkpointer:
    def __init__(self, criu: Criu, store: Store, freezer: Freezer,
                 proc: ProcReader | None = None, *, headroom: int = 64 << 20,
                 freeze_timeout: float = 5.0,
                 hook_dir: Path | None = None, ledger: FrozenLedger | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 gpu: GpuSupport | None = None, gpu_margin: int = 256 << 20,
                 mem_available: Callable[[], int] = lambda: int(psutil.virtual_memory().available),
                 lifts: LimitLifts | None = None,
                 shield: OomShield | None = None,
                 compress_level: int | None = None) -> None:
        self.criu = criu
        self.gpu = gpu
        self.gpu_margin = gpu_margin
        self.mem_available = mem_available
        self.store = store
        self.freezer = freezer
        self.proc = proc or ProcReader()
        self.headroom = headroom
        self.freeze_timeout = freeze_timeout
        self.hook_dir = hook_dir
        self.ledger = ledger or FrozenLedger(store.state / FROZEN_LEDGER, self.proc)
        if isinstance(freezer, SigstopFreezer) and freezer.before_stop is None:
            # Record-before-act for the tasks the freeze finds on its way (forks).
            freezer.before_stop = self.ledger.note
        self.shield = shield or OomShield(store.state / OOM_SHIELD, self.proc)
        # Victims are stopped at once, whatever else is going on; their dumps then share the
        # disk two at a time (the daemon's own and those asked for on the control socket).
        self.dump_slots = threading.BoundedSemaphore(DUMP_SLOTS)
        # Limits lifted for a dump's headroom: recorded durably first, bounded, put back by
        # whoever can; the daemon never takes a lifted limit for the cgroup's own.
        self.lifts = lifts or LimitLifts(store.state / LIFTS_LEDGER, self.proc)
        # The other processes of the victim's cgroup, held stopped while it is dumped.
        self.bystanders = Bystanders(self.proc, self.ledger)
        self.clock = clock
        self.wall_clock = wall_clock
        self.compress_level = compress_level  # zstd level of the pages; None: not compressed
        # The store's budget (None: none): a checkpoint it has no room for is refused before
        # the tree is stopped, once restored checkpoints are pruned (told to on_pruned).
        self.budget: StoreBudget | None = None
        self.on_pruned: Callable[[list[Prune]], None] = lambda pruned: None

    def checkpoint(self, tree: ProcessTree, cgroup: MemoryCgroup | None, reason: str,
                   on_frozen: Callable[[Frozen, float], None] | None = None, *,
                   headroom: int | None = None,
                   after_signal: Callable[[], None] | None = None,
                   requester: int | None = None, held: Collection[int] = (),
                   rights_of: int | None = None) -> CheckpointResult:
        """Checkpoint `tree`. `on_frozen(frozen, monotonic_time)` is called once it is stopped.
        `after_signal()` runs once SIGSTOP is sent to every task, before waiting for them to
        stop (the daemon thaws a cgroup-v2-frozen cgroup there: the pending SIGSTOP then takes
        the victim before it runs another instruction). `held`: tasks a chain's freeze step has
        stopped already (any other task found stopped is the user's). Raises ProcessGone if the
        tree vanished before it could be stopped, CheckpointFailed (untouched) if it holds
        oomguard or the `requester` (the process that asked for it). `rights_of`: the uid of
        the user who asked (on demand, not root): every task of the tree as it stopped must be
        theirs (real, effective and saved uid), else TreeNotYours once the tasks oomguard
        stopped are continued (a child may exec a setuid program after the request's check,
        before its SIGSTOP; once stopped it cannot)."""
        start = self.clock()
        refuse_own_tree(tree.root.pid, self.proc, requester)
        refuse_partial_job(tree, cgroup, self.proc)  # never a tree rooted inside a PID namespace
        if tree.unfit:  # a traced task, a protected one below: CRIU would fail on it
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping it: "
                                   f"{tree.unfit}", OUTCOME_UNTOUCHED, lasting=tree.unfit)
        outside = [p.pid for p in tree.members if p.session == 0]
        if outside:
            # /proc shows session 0 when the session leader lives in an outer PID namespace
            # (a job started inside a container or sandbox without setsid): CRIU refuses such
            # a task, so say why now rather than after freezing it.
            raise CheckpointFailed(
                f"checkpoint of {tree.root.pid} refused before stopping it: the session leader "
                f"of pid(s) {', '.join(map(str, outside))} is outside oomguard's PID namespace, "
                "which CRIU cannot dump (start the job with setsid, or run oomguard in the "
                "job's PID namespace)", OUTCOME_UNTOUCHED)
        members = set(tree.pids)
        if any(p.session not in members for p in tree.members):  # typed at a shell prompt
            problem = terminal_refusal(self.proc.root, tree.pids)
            if problem is not None:  # lasting: the tree is not chosen again while it lives
                raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping "
                                       f"it: {problem}", OUTCOME_UNTOUCHED, lasting=problem)
        # Lifted now, before the store's budget is asked and the tree stopped, and handed to
        # the dump as its first lift (put back with it, before the tree's mates go on).
        bridge = self._early_room(cgroup, headroom)
        try:
            with self._room_for(tree, cgroup) as room:
                return self._checkpoint_reserved(tree, cgroup, reason, on_frozen, headroom,
                                                 after_signal, requester, held, start,
                                                 rights_of, room, bridge)
        finally:
            if bridge is not None:  # refused before the stop (once: the dump's undo may have)
                with contextlib.suppress(OSError, CgroupGone):
                    bridge()

    def _early_room(self, cgroup: MemoryCgroup | None,
                    headroom: int | None) -> Callable[[], str | None] | None:
        """The headroom lifted at once for a tree about to be stopped (where its dump would
        get it: a limited cgroup, headroom given): until the stop its cgroup's tasks run on, and
        at the limit a charge made inside a system call fails with ENOMEM (cgroup v1; v2 while
        the OOM killer passes over the shielded tree), where a page fault would wait. A job
        growing at 1000 MB/s and writing its log fills the last 20 MiB under the limit in 20
        ms. Returns the release (it runs once), or None. A lift that fails is no reason to
        refuse: the dump lifts again after the stop."""
        room = self.headroom if headroom is None else headroom
        if cgroup is None or room <= 0:
            return None
        try:
            release = self.hold_room(cgroup, room)
        except (OSError, CgroupGone):
            return None
        return None if release is None else _once(release)

    @contextlib.contextmanager
    def _room_for(self, tree: ProcessTree,
                  cgroup: MemoryCgroup | None) -> Iterator[Reservation | None]:
        """Room in the store's budget for the tree's image (its memory, what it may still grow
        by under its cgroup's limit before its stop, and CRIU's metadata and logs: see
        image_estimate), held while it is dumped; the restored checkpoints it needs pruned are
        chosen now and pruned once the tree has stopped (_fit_stopped). Where only its memory
        now fits, that is reserved, and the tree is measured again once stopped. Refused,
        untouched, where not even that fits (oomguard.store.budget)."""
        with contextlib.ExitStack() as reserved:
            room: Reservation | None = None
            try:
                if self.budget is not None:
                    growth = _room_under_limit(cgroup)
                    try:
                        room = reserved.enter_context(self.budget.reserve(
                            image_estimate(tree.footprint, growth), self.on_pruned,
                            deferred=True))
                    except BudgetExceeded:
                        if growth == 0:
                            raise
                        room = reserved.enter_context(self.budget.reserve(
                            image_estimate(tree.footprint), self.on_pruned, deferred=True))
            except BudgetExceeded as exc:
                raise StoreOverBudget(f"checkpoint of {tree.root.pid} refused before stopping "
                                      f"it: {exc}", OUTCOME_UNTOUCHED, exc.figures) from exc
            except StoreError as exc:
                raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping "
                                       f"it: {exc}", OUTCOME_UNTOUCHED) from exc
            yield room  # what the dump raises goes on as it is

    def _fit_stopped(self, room: Reservation | None, tree: ProcessTree,
                     pids: Collection[int]) -> None:
        """The stopped tree's image must fit the store's budget: its reservation grown to the
        tree as it stopped (it may have grown since it was chosen), and the restored
        checkpoints it counted on pruned now, not before the stop. Raises BudgetExceeded."""
        if room is None:
            return
        room.prune_planned()
        resident = 0
        for pid in pids:
            with contextlib.suppress(ProcessGone, OSError):
                resident += self.proc.process(pid).rss_bytes
        room.grow(image_estimate(resident + tree.vram_bytes))

    def _checkpoint_reserved(self, tree: ProcessTree, cgroup: MemoryCgroup | None, reason: str,
                             on_frozen: Callable[[Frozen, float], None] | None,
                             headroom: int | None, after_signal: Callable[[], None] | None,
                             requester: int | None, held: Collection[int],
                             start: float, rights_of: int | None,
                             room: Reservation | None = None,
                             bridge: Callable[[], str | None] | None = None) -> CheckpointResult:
        # Durably noted before the first SIGSTOP: a crash from here on is thawed at next start.
        try:
            self.store.ensure()
            # Found stopped but in the ledger: oomguard's stop (a bystander, the standby's).
            held = [*held, *self.ledger.recorded(
                [p.pid for p in tree.members if p.state == USER_STOPPED_STATE])]
            self.ledger.record([p.pid for p in tree.members
                                if p.state != USER_STOPPED_STATE or p.pid in held])
        except (StoreError, OSError) as exc:
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping it: "
                                   f"{exc}", OUTCOME_UNTOUCHED) from exc
        with self.bystanders.victim(tree.pids):
            return self._checkpoint(tree, cgroup, reason, on_frozen, headroom, after_signal,
                                    requester, held, start, rights_of, room, bridge)

    def _checkpoint(self, tree: ProcessTree, cgroup: MemoryCgroup | None, reason: str,
                    on_frozen: Callable[[Frozen, float], None] | None, headroom: int | None,
                    after_signal: Callable[[], None] | None, requester: int | None,
                    held: Collection[int], start: float,
                    rights_of: int | None = None,
                    reserved: Reservation | None = None,
                    bridge: Callable[[], str | None] | None = None) -> CheckpointResult:
        # Held by another dump as a bystander: stopped by oomguard, not by its user.
        held = [*held, *self.bystanders.held_now(tree.pids)]
        # v2 has no oom_kill_disable: until the tree has stopped, the OOM killer passes it over
        # (memory taken inside one system call fails there instead of killing the job).
        shielding = shields_needed(cgroup)
        if shielding:
            self.shield.shield(list(tree.pids))
        hold = self._off_gpu(tree, cgroup, held)
        try:
            frozen = self.freezer.freeze(tree.root.pid, held)
        except ProcessGone:
            self.shield.unshield(list(tree.pids))
            self.ledger.clear(list(tree.pids))
            if hold is not None:
                put_back_limit(hold)
            raise
        pids = frozen.pids
        left: list[int] = []
        self.ledger.record(frozen.ours)
        self._unrecord(frozen.user_stopped)
        if shielding:  # children forked before the stop inherited -1000
            self.shield.shield(pids, inherited=self.shield.original_of(tree.root.pid))
        # The room lifted for the dump is the victim's alone: the rest of its cgroup waits
        # (where headroom is given: the daemon's victims and root's on-demand checkpoints;
        # and where there is a limit to share: never the rest of an unlimited cgroup, such as
        # the root one a system rule's victim may live in).
        others = Held()
        if cgroup is not None and (self.headroom if headroom is None else headroom) > 0 \
                and _limited(cgroup):
            others = self.bystanders.hold(cgroup, pids, requester)
        if after_signal is not None:
            after_signal()
        undo_limit: Callable[[], str | None] | None = bridge  # the room lifted before the stop
        checkpoint_id = new_id(tree.root.pid, self.wall_clock())
        began = dumped = False
        lock_fd: int | None = None
        terminals = DumpTerminals(tree.root.uid)
        try:
            if others.cgroup and cgroup is not None:  # and what comes in, until they go on
                self.bystanders.follow(cgroup, pids, requester, others)
            room = self.headroom if headroom is None else headroom
            if cgroup is not None and room > 0:
                raised_limit = headroom_needed(self._room_reading(cgroup, own=True), room)
                if raised_limit is not None:
                    undo_limit = _both(self._lift(cgroup, raised_limit, cap=room), undo_limit)
            # With the connector, children forked meanwhile are stopped and join the tree.
            ours = set(frozen.ours)
            frozen = self.freezer.wait_frozen(frozen, self.freeze_timeout)
            pids, left = frozen.pids, frozen.left  # left: reparented out of the tree, let go
            frozen_at = self.clock()
            if others.pids:
                frozen = replace(frozen, others_held=tuple(others.pids))
            if on_frozen is not None:
                on_frozen(frozen, frozen_at)
            caught = [pid for pid in frozen.ours if pid not in ours]
            if caught:
                self.ledger.record(caught)
            # Stopped by the user too while (or just before) oomguard stopped them.
            frozen = frozen.plus_user_stopped(self.freezer.stopped_again(frozen.ours))
            self._unrecord(frozen.user_stopped)
            foreign = None if rights_of is None else self._foreign(tree, frozen, rights_of)
            if foreign is not None:  # the limit back first (nothing runs meanwhile), then
                # only the tasks oomguard stopped continued (never one the user had stopped)
                if undo_limit is not None:
                    with contextlib.suppress(OSError, CgroupGone):
                        undo_limit()
                    undo_limit = None
                self.freezer.thaw(frozen.ours)
                raise TreeNotYours(f"{foreign} (found once the tree had stopped; not so when "
                                   "the request was checked, as after a setuid program's "
                                   "exec): refused, nothing dumped, the processes oomguard "
                                   "stopped continued", FailedCheckpoint.THAWED)
            try:
                self._fit_stopped(reserved, tree, pids)
            except BudgetExceeded as exc:  # the limit back first, then only oomguard's stops
                if undo_limit is not None:
                    with contextlib.suppress(OSError, CgroupGone):
                        undo_limit()
                    undo_limit = None
                self.freezer.thaw(frozen.ours)
                raise StoreOverBudget(f"checkpoint of {tree.root.pid} refused once it had "
                                      f"stopped (it grew, or a restored checkpoint counted on was being "
                                      f"restored): {exc}; nothing dumped, "
                                      "the processes oomguard stopped continued",
                                      FailedCheckpoint.THAWED, exc.figures) from exc
            if shielding:  # stopped: back to the originals, which CRIU saves with the images
                self.shield.unshield(pids + list(tree.pids) + left)
            if cgroup is not None and room > 0:
                # A task inside one system call (mmap MAP_POPULATE...) stops only on its way
                # out, and may have used up the limit (or the headroom given above) by then.
                raised_limit = headroom_needed(self._room_reading(cgroup, own=False), room)
                if raised_limit is not None:
                    undo_limit = _both(self._lift(cgroup, raised_limit, cap=room), undo_limit)
            meta = self._meta(checkpoint_id, tree, cgroup, reason, 0.0)
            # The tree as it stopped, which is what CRIU dumps (and a restore needs free): not
            # the one chosen before the freeze, whose short-lived children may have been
            # replaced meanwhile (a shell's `sleep`s).
            meta.pids = list(pids)
            terminals = DumpTerminals.of(self.proc.root, pids, tree.root.uid)
            terminals.record(meta.extra)
            terminals.start_dumping(checkpoint_id)  # answered (or not) while the dump is prepared
            meta.stopped_nspids = self._ns_pids(frozen.user_stopped)
            if hold is not None:
                meta.gpu_pids, meta.vram_bytes = hold.ns_pids, hold.vram_bytes
                meta.gpu_engine = self.gpu.engine if self.gpu is not None else ""
            with self.dump_slots:
                images, lock_fd = self.store.begin(meta)
                began = True
                # What the stopped tree has open, to be checked again before a restore.
                self.store.write_private(images.parent / FILES_RECORD,
                                         fileids.to_json(fileids.record(pids)))
                hook = self.criu.install_hook(self.hook_dir or self.store.state / HOOKS_DIR)
                # Checksums taken as CRIU writes, finished in its post-dump action; the pages
                # compressed alongside where asked (never waited for before the memory is free).
                packer = self._packer(images)
                digester = ImageDigester.following(images, self.store.algorithm,
                                                   drop_behind=packer is None)
                terminals.dumping_told()
                try:
                    self.criu.dump(tree.root.pid, images, hook, lock_fd,
                                   terminals.dump_args(), env=digester.env())
                except BaseException:
                    digester.abandon()
                    if packer is not None:
                        packer.abandon()
                    raise
                dumped = True  # CRIU has killed the tree: these images are all there is of it
                # CRIU has SIGKILLed the tree; its memory is back once the tasks have exited.
                self._wait_dead(pids)
                dumped_at = self.clock()
                self._put_back_room(undo_limit, others)  # the memory is back: so are they
                undo_limit = None
                digests = digester.result()
                if packer is not None:
                    digests = with_packed(digests, *packer.finish())
            meta.dump_seconds = round(dumped_at - frozen_at, 3)
            path = self.store.commit(meta, digests)
            done = self.clock()
            terminals.committed(meta.id, meta.job_command or meta.command, tree.root.pid)
        except (CriuError, StoreError, OSError, CgroupGone) as exc:
            if dumped:
                # Never deleted: the partial stays, listed as incomplete, completed at the next
                # start (or restore) once the store can take the commit. The tree is gone: the
                # room lifted for it is put back before its holders are told.
                self._put_back_room(undo_limit, others)
                undo_limit, others = None, Held()
                terminals.committed(checkpoint_id, tree.root.command, tree.root.pid)
                raise CheckpointFailed(
                    f"checkpoint of {tree.root.pid}: the process was dumped and is gone, but "
                    f"the commit failed ({exc}); its images are intact and it is listed as "
                    f"incomplete ({checkpoint_id}): it is completed at the daemon's next start "
                    "or when restored", OUTCOME_INCOMPLETE) from exc
            full = self._disk_full(exc)  # before the partial goes: what the dump met
            if began:
                self.store.keep_failed_log(checkpoint_id)  # CRIU's whole story, for a look
                self.store.abort(checkpoint_id, lock_fd)  # closes the lock, as it goes
                lock_fd = None
            busy = ""  # the limit back before anything else (the tree cannot grow meanwhile)
            if undo_limit is not None:
                try:
                    busy = undo_limit() or ""
                except (OSError, CgroupGone) as undo_exc:
                    busy = str(undo_exc)
                undo_limit = None
            terminals.failed()  # the limit is back: a holder slow to answer holds nothing
            outcome = self._thaw_after_failure(frozen)
            gpu_note = ""
            if hold is not None and hold.suspended and outcome == FailedCheckpoint.THAWED and self.gpu:
                trouble = back_to_gpu(self.gpu, hold.pids)
                gpu_note = ("; its CUDA state is back on the GPU" if trouble is None else
                            f"; its CUDA state could NOT be put back on the GPU: {trouble}")
            busy_note = (f"; the limit lifted for its dump could not be put back: {busy}"
                         if busy else "")
            if full is not None:
                raise StoreOverBudget(
                    f"checkpoint of {tree.root.pid} failed: the store's disk filled during "
                    f"the dump ({full.describe()}): {exc}{gpu_note}{busy_note}", outcome,
                    full.fields(), limit_busy=busy) from exc
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} failed: {exc}{gpu_note}"
                                   f"{busy_note}", outcome,
                                   lasting=lasting_failure(str(exc)) or "",
                                   limit_busy=busy) from exc
        finally:
            if shielding:
                self.shield.unshield(pids + list(tree.pids) + left)
            if hold is not None:
                put_back_limit(hold)
            if lock_fd is not None:
                os.close(lock_fd)
            self._put_back_room(undo_limit, others)
            with contextlib.suppress(OSError):
                self.ledger.clear(pids + list(tree.pids) + left)
        timings = CheckpointTimings(freeze_s=frozen_at - start, dump_s=dumped_at - frozen_at,
                                    commit_s=done - dumped_at, total_s=done - start,
                                    holders_s=terminals.told_in)
        return CheckpointResult(meta=meta, path=path, timings=timings)

    def _foreign(self, tree: ProcessTree, frozen: Frozen, uid: int) -> str | None:
        """Why the tree as it stopped is not all `uid`'s (a task of another user, or holding
        their rights: a setuid exec after the request was checked), or None."""
        tasks = [(p.pid, p.comm, p.uids[:3] or (p.uid,))
                 for p in self.proc.processes(frozen.pids)]
        return foreign_of(tasks, tree.root.pid, uid)

    def _disk_full(self, exc: BaseException) -> BudgetReading | None:
        """The budget's figures where a failed dump ran out of room: ENOSPC said, or the
        store's file system (nearly) full now (a full disk often keeps CRIU from logging
        why)."""
        if self.budget is None:
            return None
        try:
            reading = self.budget.reading()
        except StoreError:
            return None
        return reading if _out_of_space(exc) or reading.free < FULL_DISK else None

    def _put_back_room(self, undo_limit: Callable[[], str | None] | None, others: Held) -> None:
        """The limit as it was, then the rest of the cgroup continued (in that order: what
        was lifted for the dump is never theirs)."""
        if undo_limit is not None:
            with contextlib.suppress(OSError, CgroupGone):
                undo_limit()
        self.bystanders.release(others)

    def _packer(self, images: Path) -> Packer | None:
        if self.compress_level is None:
            return None
        try:
            return Packer(images, self.compress_level)
        except StoreError:
            return None  # no zstandard: stored plain (the setting was checked at start-up)

    def _off_gpu(self, tree: ProcessTree, cgroup: MemoryCgroup | None,
                 held: Collection[int]) -> GpuHold | None:
        """A tree holding GPU memory: its CUDA state into host memory first (the ledger has
        the pids already); refused, untouched, when that is not possible."""
        if self.gpu is None or not self.gpu.accounting:
            return None

        def thaw_ours(pids: list[int]) -> None:  # a task the user had stopped stays stopped
            self.freezer.thaw([pid for pid in pids if pid in held or not self._stopped(pid)])

        def lift(cgroup: MemoryCgroup, new_limit: int) -> Callable[[], None]:
            release = self._lift(cgroup, new_limit)

            def put_back() -> None:
                release()  # one that cannot be put back yet stays pending: the settling's
            return put_back
        try:
            return move_off_gpu(self.gpu, tree, cgroup, margin=self.gpu_margin,
                                mem_available=self.mem_available, lift=lift, thaw=thaw_ours)
        except GpuRefused as exc:
            with contextlib.suppress(OSError):
                self.ledger.clear(list(tree.pids))
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping it: "
                                   f"{exc}", OUTCOME_UNTOUCHED) from exc

    def hold_room(self, cgroup: MemoryCgroup, room: int) -> Callable[[], str | None] | None:
        """The limit lifted by `room` over what the cgroup uses now (bounded as a dump's lift
        is): see _early_room. Returns the release, or None (room enough, no limit, or none
        asked for)."""
        if room <= 0:
            return None
        raised = headroom_needed(self._room_reading(cgroup, own=True), room)
        return None if raised is None else self._lift(cgroup, raised, cap=room)

    def limit_lifted(self, path: Path) -> bool:
        """Whether oomguard has lifted this cgroup's limit (or still owes putting it back)."""
        return self.lifts.lifted(path)

    def _room_reading(self, cgroup: MemoryCgroup, own: bool) -> MemorySnapshot:
        """Usage and limit only (what headroom needs; no memory.stat on the way to the dump),
        with the cgroup's `own` limit or the one in force."""
        lifted, own_limit = self.lifts.own_limit(cgroup.path) if own else (False, None)
        return MemorySnapshot(usage_bytes=cgroup.usage(),
                              limit_bytes=own_limit if lifted else cgroup.limit(),
                              anon_bytes=0, file_bytes=0, oom_kills=0, under_oom=False)

    def own_snapshot(self, cgroup: MemoryCgroup) -> MemorySnapshot:
        """A snapshot with the cgroup's own limit, not one oomguard lifted for a dump."""
        snap = cgroup.snapshot()
        lifted, own = self.lifts.own_limit(cgroup.path)
        return replace(snap, limit_bytes=own) if lifted else snap

    def _lift(self, cgroup: MemoryCgroup, new_limit: int,
              cap: int | None = None) -> Callable[[], str | None]:
        """The release returns why the limit could not be put back ("" or None: it was): it
        then stays pending in the ledger, and the one who released acts on the cgroup (a
        chain's next step, down to its kill: oomguard/act/chainsteps.py)."""
        return self.lifts.lift(cgroup, new_limit, cap)

    def _wait_dead(self, pids: list[int], timeout: float = 5.0) -> None:
        deadline = self.clock() + timeout
        for pid in pids:
            while self.clock() < deadline:
                try:
                    if self.proc.state(pid) in "ZX":
                        break
                except ProcessGone:
                    break
                time.sleep(0.002)

    def _thaw_after_failure(self, frozen: Frozen) -> FailedCheckpoint:
        """After a failed dump CRIU has resumed the tree (stopped, as it found it): thawed,
        the tasks the user had stopped left stopped. A rule's kill after a failed checkpoint
        is the action chain's next step (chain.py), never decided here."""
        self.freezer.thaw(frozen.ours)
        return FailedCheckpoint.THAWED

    def _unrecord(self, user_stopped: list[int]) -> None:
        """Tasks the user had stopped leave the ledger: a restart after a crash thaws what the
        ledger names, and these are never continued."""
        if user_stopped:
            with contextlib.suppress(OSError):
                self.ledger.clear(user_stopped)

    def _stopped(self, pid: int) -> bool:
        try:
            return self.proc.state(pid) == USER_STOPPED_STATE
        except ProcessGone:
            return False

    def _ns_pids(self, pids: list[int]) -> list[int]:
        """PIDs in the tree's own PID namespace (NSpid's last field): what a restore maps back
        to host PIDs (a tree started by `oomguard exec` gets new host PIDs)."""
        return sorted(info.nspid[-1] for info in self.proc.processes(pids))

    def _meta(self, checkpoint_id: str, tree: ProcessTree, cgroup: MemoryCgroup | None,
              reason: str, dump_seconds: float) -> CheckpointMeta:
        root = tree.root
        return CheckpointMeta(
            id=checkpoint_id, pid=root.pid, pids=list(tree.pids), command=root.command,
            comm=root.comm, uid=root.uid, user=user_name(root.uid),
            cgroup=cgroup.rel_path if cgroup is not None else "",
            cgroup_version=cgroup.version if cgroup is not None else 0,
            rss_bytes=tree.rss_bytes, reason=reason,
            criu_version=format_version(self.criu.version), created=self.wall_clock(),
            pidns=root.is_pidns_init, dump_seconds=round(dump_seconds, 3),
            extra=owner_fields(cgroup.rel_path) if cgroup is not None else {}, **job_fields(tree),
        )


def tree_of(pid: int, proc: ProcReader) -> ProcessTree:
    """The tree rooted at `pid` (for `oomguard checkpoint PID`). Raises ProcessGone."""
    members = proc.processes(proc.descendants(pid))
    if not members or members[0].pid != pid:
        raise ProcessGone(f"process {pid} is gone")
    return ProcessTree(root=members[0], members=tuple(members))


def _out_of_space(exc: BaseException) -> bool:
    """The dump or its files ran out of room on the store's disk (ENOSPC, EDQUOT)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def _room_under_limit(cgroup: MemoryCgroup | None) -> int:
    """What the cgroup's processes may still take before its limit (0: no limit, or gone)."""
    if cgroup is None:
        return 0
    try:
        limit = cgroup.limit()
        return 0 if limit is None else max(0, limit - cgroup.usage())
    except (OSError, CgroupGone):
        return 0


def _limited(cgroup: MemoryCgroup) -> bool:
    try:
        return cgroup.limit() is not None
    except (OSError, CgroupGone):
        return False


def _once(release: Callable[[], str | None]) -> Callable[[], str | None]:
    """A release that acts the first time it is called, and answers None after."""
    pending = [release]

    def once() -> str | None:
        return pending.pop()() if pending else None
    return once


def _both(last: Callable[[], str | None],
          first: Callable[[], str | None] | None) -> Callable[[], str | None]:
    """One undo for two limit lifts: the later one first (the first's answer is the one:
    the own limit is put back when the last holder lets go)."""
    if first is None:
        return last

    def undo() -> str | None:
        with contextlib.suppress(OSError, CgroupGone):
            last()
        return first()
    return undo
