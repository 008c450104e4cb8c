"""Freeze -> headroom -> dump -> durable -> free: one checkpoint of one process tree.

The steps each say what they did and how it is undone; a runner (oomguard.model.unwind) undoes
it once, latest first, however the checkpoint ends. On any failure the tree is thawed and keeps
running, and the raised CheckpointFailed says so and why (a rule's kill after a failed
checkpoint is its action chain's next step: chain.py). A process is never left stopped, and one
the user had stopped is never continued (meta.json names it: restore leaves it stopped too).

Beside it: the refusals before the stop (precheck.py), the store's room (storeroom.py), the
limit lifted for the dump (dumproom.py), a GPU tree's hand-off (gpuhandoff.py), the new
checkpoint's description (newmeta.py), the run's state (checkpointrun.py), how each step is
undone (checkpointundo.py) and the errors a failure raises (dumpfailure.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

import psutil

from oomguard.act.bystanders import Bystanders
from oomguard.act.criu import Criu
from oomguard.act.freezer import Freezer, SigstopFreezer
from oomguard.act.frozen import USER_STOPPED_STATE, Frozen
from oomguard.act.lifts import LimitLifts
from oomguard.act.oomshield import OomShield
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.watch import shields_needed
from oomguard.gpu.offload import GpuHold
from oomguard.gpu.runtime import GpuSupport
from oomguard.lifecycle import fileids
from oomguard.lifecycle.checkpointrun import (
    CheckpointRequest,
    CheckpointResult,
    CheckpointRun,
    CheckpointTimings,
)
from oomguard.lifecycle.checkpointundo import (
    FREEZE,
    GPU,
    IMAGES,
    LEDGER,
    LIMIT,
    OTHERS,
    RESERVATION,
    SHIELD,
    TERMINALS,
    VICTIM,
    CheckpointUndo,
)
from oomguard.lifecycle.dumpfailure import commit_failed, dump_failed
from oomguard.lifecycle.dumproom import DumpRoom, limited
from oomguard.lifecycle.fileids import FILES_RECORD
from oomguard.lifecycle.gpuhandoff import hand_off_gpu
from oomguard.lifecycle.newmeta import describe_tree, ns_pids
from oomguard.lifecycle.precheck import refuse_before_stop
from oomguard.lifecycle.storeroom import disk_full, fit_stopped, room_for
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
from oomguard.model.unwind import Undos, unwinding
from oomguard.policy.retention import Prune
from oomguard.policy.rights import foreign_of
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import ProcReader
from oomguard.store.budget import BudgetExceeded, StoreBudget
from oomguard.store.checkpoints import Store, new_id
from oomguard.store.compression import Packer
from oomguard.store.digest import ImageDigester, with_packed
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import FROZEN_LEDGER, HOOKS_DIR, LIFTS_LEDGER, OOM_SHIELD
from oomguard.terminal.checkpointing import DumpTerminals

DUMP_SLOTS = 2
# What a failure once the tree has stopped is told as a failed dump (or commit) from.
DUMP_ERRORS = (CriuError, StoreError, OSError, CgroupGone)
OUTCOME_UNTOUCHED = FailedCheckpoint.UNTOUCHED  # refused before the process was stopped
OUTCOME_INCOMPLETE = FailedCheckpoint.INCOMPLETE  # gone, images intact, commit to be finished



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
        self.room = DumpRoom(self.lifts)
        # The other processes of the victim's cgroup, held stopped while it is dumped.
        self.bystanders = Bystanders(self.proc, self.ledger)
        self.undo = CheckpointUndo(store, freezer, self.shield, self.bystanders, self.ledger, gpu)
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
        before its SIGSTOP; once stopped it cannot).

        The steps (_walk), each saying what it did and its undo; whatever ends the run, what
        was done is undone once, latest first (oomguard.model.unwind), the lifted limit
        before anything else. A failure once the tree has stopped is then told as a failed
        dump (the tree thawed) or, once CRIU has dumped it, a failed commit."""
        start = self.clock()
        refuse_before_stop(tree, cgroup, self.proc, requester)
        request = CheckpointRequest(tree, cgroup, reason, on_frozen, after_signal, requester,
                                    self.headroom if headroom is None else headroom,
                                    rights_of, start)
        run = CheckpointRun(terminals=DumpTerminals(tree.root.uid), held=list(held))
        try:
            with unwinding() as undos:
                self._walk(request, run, undos)
        except DUMP_ERRORS as exc:
            if not run.stopped:
                raise
            if run.dumped:
                raise commit_failed(tree.root.pid, run.checkpoint_id, exc) from exc
            raise dump_failed(tree.root.pid, exc, FailedCheckpoint.THAWED, run.full,
                              run.gpu_note, run.busy) from exc
        assert run.meta is not None and run.path is not None
        timings = CheckpointTimings(freeze_s=run.frozen_at - request.start,
                                    dump_s=run.dumped_at - run.frozen_at,
                                    commit_s=run.done_at - run.dumped_at,
                                    total_s=run.done_at - request.start,
                                    holders_s=run.terminals.told_in)
        return CheckpointResult(meta=run.meta, path=run.path, timings=timings)

    def _walk(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """The steps, in order, each saying what it did and its undo in `undos`."""
        steps = (self._lift_early, self._reserve, self._record, self._stop, self._settle,
                 self._refuse_stopped, self._describe, self._dump, self._commit)
        try:
            for step in steps:
                step(request, run, undos)
        except DUMP_ERRORS as exc:
            if run.stopped and not run.dumped:  # before the partial goes: what the dump met
                run.full = disk_full(self.budget, exc)
            raise

    # -- the steps, in order -----------------------------------------------------------------

    def _lift_early(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """The room over the cgroup's limit, lifted before the store's budget is asked and the
        tree stopped: the dump's first lift (put back with the later ones)."""
        run.undo_limit = self.room.early(request.cgroup, request.headroom)
        undos.did(LIMIT, lambda failure: self.undo.put_back_limit(run), first=True)

    def _reserve(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """The store's room for the images (storeroom.room_for), held until the end."""
        run.room = undos.enter(RESERVATION, room_for(self.budget, self.on_pruned,
                                                     request.tree, request.cgroup))

    def _record(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """Durably noted before the first SIGSTOP: a crash from here on is thawed at the next
        start (the tasks found stopped but in the ledger were stopped by oomguard: a
        bystander, the standby's). The tree is a victim then, never held as a bystander."""
        tree = request.tree
        try:
            self.store.ensure()
            run.held = [*run.held, *self.ledger.recorded(
                [p.pid for p in tree.members if p.state == USER_STOPPED_STATE])]
            self.ledger.record([p.pid for p in tree.members
                                if p.state != USER_STOPPED_STATE or p.pid in run.held])
        except (StoreError, OSError) as exc:
            raise CheckpointFailed(f"checkpoint of {tree.root.pid} refused before stopping it: "
                                   f"{exc}", OUTCOME_UNTOUCHED) from exc
        undos.did(LEDGER, lambda failure: self.undo.clear_ledger(request, run))
        undos.enter(VICTIM, self.bystanders.victim(tree.pids))
        # Held by another dump as a bystander: stopped by oomguard, not by its user.
        run.held = [*run.held, *self.bystanders.held_now(tree.pids)]

    def _stop(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """SIGSTOP to the tree (not yet waited for), shielded from the OOM killer until then
        where the cgroup needs it (v2 has no oom_kill_disable: memory taken inside one system
        call fails there instead of killing the job), its CUDA state off the GPU first; the
        rest of its cgroup held stopped while it is dumped (where there is a limit to share
        and headroom to give: never the rest of an unlimited cgroup, such as the root one a
        system rule's victim may live in). Raises ProcessGone if the tree vanished before it
        could be stopped."""
        tree, cgroup = request.tree, request.cgroup
        run.shielding = shields_needed(cgroup)
        if run.shielding:
            self.shield.shield(list(tree.pids))
            undos.did(SHIELD, lambda failure: self.shield.unshield(
                run.pids + list(tree.pids) + run.left))
        run.hold = self._off_gpu(tree, cgroup, run.held)  # refused: CheckpointFailed, untouched
        if run.hold is not None:
            undos.did(GPU, lambda failure: self.undo.put_back_gpu(run, failure))
        run.frozen = self.freezer.freeze(tree.root.pid, run.held)
        run.stopped = True
        run.checkpoint_id = new_id(tree.root.pid, self.wall_clock())
        undos.did(FREEZE, lambda failure: self.undo.thaw(run))
        self.ledger.record(run.frozen.ours)
        self._unrecord(run.frozen.user_stopped)
        if run.shielding:  # children forked before the stop inherited -1000
            self.shield.shield(run.frozen.pids, inherited=self.shield.original_of(tree.root.pid))
        if cgroup is not None and request.headroom > 0 and limited(cgroup):
            run.others = self.bystanders.hold(cgroup, run.frozen.pids, request.requester)
            undos.did(OTHERS, lambda failure: self.undo.let_others_go(run))
            if run.shielding:  # stopped tasks are the OOM killer's too: never theirs meanwhile
                self.shield.shield(run.others.pids)
        if request.after_signal is not None:
            request.after_signal()

    def _settle(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """The stop waited for: arrivals in the cgroup held too, the headroom lifted over the
        cgroup's own limit, the children forked meanwhile stopped and recorded (with the
        connector), and the tasks the user stopped too left to them."""
        cgroup = request.cgroup
        if run.others.cgroup and cgroup is not None:  # and what comes in, until they go on
            self.bystanders.follow(cgroup, run.pids, request.requester, run.others)
        # Unthrottled where shielded (v2): a task inside one system call stops on its way out;
        # at the limit its shielded charge fails, where memory.high would have it crawl.
        self._lift_for_dump(request, run, own=True, unthrottle=run.shielding)
        ours = set(run.frozen.ours)
        run.frozen = self.freezer.wait_frozen(run.frozen, self.freeze_timeout)
        if run.shielding and run.frozen.stopped is False:  # once more before it is unshielded
            run.frozen = self.freezer.wait_frozen(run.frozen, self.freeze_timeout)
        run.frozen_at = self.clock()
        if run.others.pids:
            run.frozen = replace(run.frozen, others_held=tuple(run.others.pids))
        if request.on_frozen is not None:
            request.on_frozen(run.frozen, run.frozen_at)
        caught = [pid for pid in run.frozen.ours if pid not in ours]
        if caught:
            self.ledger.record(caught)
        # Stopped by the user too while (or just before) oomguard stopped them.
        run.frozen = run.frozen.plus_user_stopped(self.freezer.stopped_again(run.frozen.ours))
        self._unrecord(run.frozen.user_stopped)

    def _refuse_stopped(self, request: CheckpointRequest, run: CheckpointRun,
                        undos: Undos) -> None:
        """Refused once stopped, nothing dumped: a task that is not the asking user's (as
        after a setuid program's exec), or a tree grown past the store's budget. The undos
        put the limit back first (nothing runs meanwhile), then continue only the tasks
        oomguard stopped (never one the user had stopped)."""
        tree = request.tree
        foreign = None if request.rights_of is None else \
            self._foreign(tree, run.frozen, request.rights_of)
        if foreign is not None:
            raise TreeNotYours(f"{foreign} (found once the tree had stopped; not so when "
                               "the request was checked, as after a setuid program's "
                               "exec): refused, nothing dumped, the processes oomguard "
                               "stopped continued", FailedCheckpoint.THAWED)
        try:
            fit_stopped(run.room, tree, run.pids, self.proc)
        except BudgetExceeded as exc:
            raise StoreOverBudget(f"checkpoint of {tree.root.pid} refused once it had "
                                  f"stopped (it grew, or a restored checkpoint counted on was "
                                  f"being restored): {exc}; nothing dumped, "
                                  "the processes oomguard stopped continued",
                                  FailedCheckpoint.THAWED, exc.figures) from exc

    def _describe(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """The tree unshielded (back to its own oom_score_adj, which CRIU saves with the
        images), lifted again if it must be, and described as it stopped, which is what CRIU
        dumps (and a restore needs free): not the tree chosen before the freeze, whose
        short-lived children may have been replaced meanwhile (a shell's `sleep`s). Its
        terminal holders are told to get ready."""
        tree = request.tree
        undos.now(SHIELD)
        self._lift_for_dump(request, run, own=False)
        meta = describe_tree(run.checkpoint_id, tree, request.cgroup, request.reason,
                             self.criu.version, self.wall_clock())
        meta.pids = list(run.pids)
        run.terminals = DumpTerminals.of(self.proc.root, run.pids, tree.root.uid)
        run.terminals.record(meta.extra)
        run.terminals.start_dumping(run.checkpoint_id)  # answered while the dump is prepared
        undos.did(TERMINALS, lambda failure: self.undo.tell_terminals(request, run))
        meta.stopped_nspids = ns_pids(self.proc, run.frozen.user_stopped)
        if run.hold is not None:
            meta.gpu_pids, meta.vram_bytes = run.hold.ns_pids, run.hold.vram_bytes
            meta.gpu_engine = self.gpu.engine if self.gpu is not None else ""
        run.meta = meta

    def _dump(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """CRIU dumps the stopped tree into a new checkpoint's images (two dumps at a time),
        checksummed as written and compressed alongside where asked; once the tree's memory
        is back, the lifted limit is put back and the rest of the cgroup continued."""
        assert run.meta is not None
        with self.dump_slots:
            images, run.lock_fd = self.store.begin(run.meta)
            run.began = True
            undos.did(IMAGES, lambda failure: self.undo.leave_images(run))
            # What the stopped tree has open, to be checked again before a restore.
            self.store.write_private(images.parent / FILES_RECORD,
                                     fileids.to_json(fileids.record(run.pids)))
            hook = self.criu.install_hook(self.hook_dir or self.store.state / HOOKS_DIR)
            # Checksums taken as CRIU writes, finished in its post-dump action; the pages
            # compressed alongside where asked (never waited for before the memory is free).
            packer = self._packer(images)
            digester = ImageDigester.following(images, self.store.algorithm,
                                               drop_behind=packer is None)
            run.terminals.dumping_told()
            try:
                self.criu.dump(request.tree.root.pid, images, hook, run.lock_fd,
                               run.terminals.dump_args(), env=digester.env())
            except BaseException:
                digester.abandon()
                if packer is not None:
                    packer.abandon()
                raise
            run.dumped = True  # CRIU has killed the tree: these images are all there is of it
            # CRIU has SIGKILLed the tree; its memory is back once the tasks have exited.
            self._wait_dead(run.pids)
            run.dumped_at = self.clock()
            undos.now(LIMIT)  # the memory is back: so are the limit and the cgroup's others
            undos.now(OTHERS)
            digests = digester.result()
            if packer is not None:
                digests = with_packed(digests, *packer.finish())
        run.meta.dump_seconds = round(run.dumped_at - run.frozen_at, 3)
        run.digests = digests

    def _commit(self, request: CheckpointRequest, run: CheckpointRun, undos: Undos) -> None:
        """The images made durable and listed; the holders told where it is."""
        assert run.meta is not None
        run.path = self.store.commit(run.meta, run.digests)
        run.done_at = self.clock()
        undos.now(TERMINALS)

    def _lift_for_dump(self, request: CheckpointRequest, run: CheckpointRun, own: bool,
                       unthrottle: bool = False) -> None:
        """The headroom over the cgroup's `own` limit (before the stop is waited for), or over
        the limit in force (once stopped: a task inside one system call, mmap MAP_POPULATE...,
        stops only on its way out, and may have used up the limit, or the headroom given
        before, by then). Put back with the lifts before it (_put_back_limit)."""
        run.undo_limit = self.room.over(request.cgroup, request.headroom, own, run.undo_limit,
                                        unthrottle)

    def _foreign(self, tree: ProcessTree, frozen: Frozen, uid: int) -> str | None:
        """Why the tree as it stopped is not all `uid`'s (a task of another user, or holding
        their rights: a setuid exec after the request was checked), or None."""
        tasks = [(p.pid, p.comm, p.uids[:3] or (p.uid,))
                 for p in self.proc.processes(frozen.pids)]
        return foreign_of(tasks, tree.root.pid, uid)

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
        the pids already); refused, untouched, when that is not possible (gpuhandoff.py)."""
        if self.gpu is None or not self.gpu.accounting:
            return None
        return hand_off_gpu(self.gpu, tree, cgroup, held, margin=self.gpu_margin,
                            mem_available=self.mem_available, room=self.room,
                            freezer=self.freezer, proc=self.proc, ledger=self.ledger)

    def limit_lifted(self, path: Path) -> bool:
        """Whether oomguard has lifted this cgroup's limit (or still owes putting it back)."""
        return self.room.lifted(path)

    def own_snapshot(self, cgroup: MemoryCgroup) -> MemorySnapshot:
        """A snapshot with the cgroup's own limit, not one oomguard lifted for a dump."""
        return self.room.own_snapshot(cgroup)

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

    def _unrecord(self, user_stopped: list[int]) -> None:
        """Tasks the user had stopped leave the ledger: a restart after a crash thaws what the
        ledger names, and these are never continued."""
        if user_stopped:
            with contextlib.suppress(OSError):
                self.ledger.clear(user_stopped)


def tree_of(pid: int, proc: ProcReader) -> ProcessTree:
    """The tree rooted at `pid` (for `oomguard checkpoint PID`). Raises ProcessGone."""
    members = proc.processes(proc.descendants(pid))
    if not members or members[0].pid != pid:
        raise ProcessGone(f"process {pid} is gone")
    return ProcessTree(root=members[0], members=tuple(members))
