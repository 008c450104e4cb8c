"""What the control socket (and the CLI, acting directly as root) may do, and for whom.

Root may see and act on every checkpoint. Any other user may list, show, restore and forget
only checkpoints of processes they owned, checkpoint only their own processes, and restore only
into the checkpoint's own cgroup or one delegated to them. Everything else is refused, and a
checkpoint a user may not see is reported as not found (its existence is not leaked).
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.lifecycle.checkpoint import OUTCOME_UNTOUCHED, Checkpointer, tree_of
from oomguard.lifecycle.jobroot import job_root
from oomguard.lifecycle.restore import Restorer, memory_pages_bytes
from oomguard.lifecycle.restorefit import GuardLookup, check_fits
from oomguard.lifecycle.restoreoutcome import failure_fields
from oomguard.model.errors import (
    AmbiguousId,
    CgroupGone,
    CheckpointFailed,
    OomguardError,
    ProcessGone,
    RestoreFailed,
    StoreError,
    TreeNotYours,
    UnknownCheckpoint,
)
from oomguard.observe.events import CheckpointDone, EventSink, RestoreDone
from oomguard.observe.events import RestoreFailed as RestoreFailedEvent
from oomguard.policy.preferences import Preferences, select_victims
from oomguard.policy.rights import foreign_task, untouchable_task
from oomguard.policy.victims import build_trees
from oomguard.respond.pageoutstep import PageoutTools
from oomguard.sense.procfs import ProcReader
from oomguard.sense.selfguard import own_family
from oomguard.store.budget import StoreBudget
from oomguard.store.checkpoints import CheckpointMeta, Store, validate_id
from oomguard.store.ids import names_a_pid, newest_holding, resolve_id
from oomguard.store.names import PARTIAL_PREFIX
from oomguard.store.pagedout import PagedOutRecord, PagedOutTree

ROOT = 0


class PermissionDenied(OomguardError):
    """The caller may not do this."""


class Service:
    def __init__(self, store: Store, restorer: Restorer, checkpointer: Checkpointer,
                 layout: CgroupLayout, proc: ProcReader | None = None,
                 status: Callable[[], dict[str, Any]] | None = None,
                 user_headroom: Callable[[MemoryCgroup], int] = lambda cgroup: 0) -> None:
        self.store = store
        # Headroom for on-demand checkpoints by non-root users (none unless a rule says so:
        # the room lifted for a dump could be taken by the user's other processes).
        self.user_headroom = user_headroom
        self.restorer = restorer
        self.checkpointer = checkpointer
        self.layout = layout
        self.proc = proc or ProcReader()
        self._status = status
        self.restore_lock = threading.Lock()
        # Told of what was done on request: the checkpoints and restores (and the restores
        # that failed) as typed events (the daemon publishes them: the log, metrics, hooks,
        # D-Bus), what else was done as a log event (on_event).
        self.events: EventSink | None = None
        self.on_event: Callable[..., None] | None = None
        # The daemon's rules: a restore into a guarded cgroup must fit under its threshold.
        self.guard_of: GuardLookup | None = None
        # The preferences of the rule guarding a cgroup (the daemon's; None: no rule's)
        self.prefs_of: Callable[[MemoryCgroup], Preferences | None] | None = None
        # After every checkpoint asked for here, done or not: the daemon settles at once what
        # it may have left (a limit lifted for its dump that could not be put back).
        self.after_checkpoint: Callable[[], None] | None = None
        # The store's budget, shown by `status` (None: not shown).
        self.budget: StoreBudget | None = None

    # -- authorization ---------------------------------------------------------------------------

    def resolve(self, uid: int, text: str) -> str:
        """The checkpoint id `text` names for `uid`: an id (as before: a store entry by that
        name, even a malformed one, which root is told about), else `last` or a unique prefix
        among the checkpoints `uid` may see (AmbiguousId when several match)."""
        validate_id(text)
        if os.path.lexists(self.store.root / text) or \
                os.path.lexists(self.store.root / (PARTIAL_PREFIX + text)):
            return text
        visible = [m for m in self.store.list() if uid == ROOT or m.uid == uid]
        return resolve_id(text, visible, whose="" if uid == ROOT else " of yours")

    def _visible(self, uid: int, text: str) -> CheckpointMeta:
        checkpoint_id = self.resolve(uid, text)
        try:
            meta = self.store.get(checkpoint_id)
        except StoreError:
            if uid == ROOT and os.path.lexists(self.store.root / checkpoint_id):
                raise  # root is told why it is skipped (a symlink, a malformed meta.json...)
            meta = None
        if meta is None or (uid != ROOT and meta.uid != uid):
            raise UnknownCheckpoint(f"no checkpoint {checkpoint_id!r}"
                             + ("" if uid == ROOT else " of yours"))
        return meta

    def _target_cgroup(self, uid: int, path: str | None, meta: CheckpointMeta
                       ) -> tuple[MemoryCgroup | None, MemoryCgroup | None]:
        """(target, original): where to restore. A user may name only a cgroup delegated to
        them (they own its cgroup.procs); otherwise anyone could escape their limit."""
        if path:
            try:
                target = open_cgroup(path, self.layout)
            except ValueError as exc:
                raise RestoreFailed(f"--cgroup: {exc}") from None
            if not target.exists():
                raise RestoreFailed(f"target cgroup {target.path} does not exist")
            if uid != ROOT and target.rel_path != meta.cgroup:
                try:
                    owner = os.stat(target.path / "cgroup.procs").st_uid
                except OSError:
                    owner = -1
                if owner != uid:
                    raise PermissionDenied(f"you may restore only into the checkpoint's own "
                                           f"cgroup or one delegated to you, not {target.path}")
            return target, None
        if meta.cgroup and self.layout.memory_mount is not None:
            original = open_cgroup(meta.cgroup, self.layout)
            return None, original if original.exists() else None
        return None, None

    # -- verbs ---------------------------------------------------------------------------------------

    def list(self, uid: int) -> list[dict[str, Any]]:
        return [asdict(m) for m in self.store.list() if uid == ROOT or m.uid == uid]

    def paged_out(self, uid: int) -> builtins.list[dict[str, Any]]:
        """The trees paged out and kept stopped (the chain's pageout step): root sees all,
        a user their own."""
        record = PagedOutRecord(self.store.state)
        return [_paged_out_fields(t) for t in record.trees() if uid == ROOT or t.uid == uid]

    def resume(self, uid: int, key: str) -> dict[str, Any]:
        """Continue a paged-out tree, by its id or the PID of one of its tasks (root, or the
        tree's owner); it takes its pages back from swap as it touches them."""
        tools = PageoutTools.for_store(self.store.state)
        tree = tools.record.find(key)
        if tree is None or (uid != ROOT and tree.uid != uid):
            raise UnknownCheckpoint(f"no paged-out tree {key}")
        done = tools.resumer().resume(tree)
        if done.hold_left:
            raise RestoreFailed(f"paged-out tree {tree.id} is still held, its cgroup could not "
                                f"be released: {done.hold_left}")
        if self.on_event is not None:
            self.on_event("pageout.resumed", paged_out_id=tree.id, pid=tree.root_pid,
                          uid=tree.uid, requested_by=uid, continued=done.continued,
                          gone=done.gone, swap_removed=done.swap_removed,
                          swap_kept=done.swap_kept or None)
        return {"id": tree.id, "pid": tree.root_pid, "continued": done.continued,
                "gone": done.gone, "swap_removed": done.swap_removed,
                "swap_kept": done.swap_kept}

    def skipped(self, uid: int) -> builtins.list[dict[str, str]]:
        """Store entries skipped as malformed or symlinks, with why: for root only (another
        user learns nothing of entries that are not theirs)."""
        if uid != ROOT:
            return []
        return [{"entry": name, "reason": why} for name, why in self.store.scan().skipped]

    def show(self, uid: int, checkpoint_id: str) -> dict[str, Any]:
        """A checkpoint by id (or prefix, `last`), or by a PID: the newest checkpoint of the
        caller's whose tree held that process (the one a person saw in `ps`), or whose restore
        is the live job that process is in."""
        paged = PagedOutRecord(self.store.state).find(checkpoint_id)  # by its id or a PID
        if paged is not None and (uid == ROOT or paged.uid == uid):
            return _paged_out_fields(paged)  # a live stopped process: what `ps` shows now
        if names_a_pid(checkpoint_id):
            pid = int(checkpoint_id)
            visible = [m for m in self.store.list() if uid == ROOT or m.uid == uid]
            try:  # a process of a restored exec job: the job's init is the restored root
                root: int | None = job_root(self.proc, pid)
            except ProcessGone:
                root = None
            checkpoint_id = newest_holding(pid, visible, job_root=root,
                                           whose="" if uid == ROOT else " of yours")
        return asdict(self._visible(uid, checkpoint_id))

    def forget(self, uid: int, checkpoint_id: str) -> dict[str, Any]:
        meta = self._visible(uid, checkpoint_id)
        self.store.forget(meta.id)
        return {"id": meta.id}

    def restore(self, uid: int, checkpoint_id: str, cgroup: str | None = None,
                force: bool = False, lazy: bool = False) -> dict[str, Any]:
        """Every way a restore of an existing checkpoint fails is told (events:
        RestoreFailed) before it is raised; an unknown id, or one the caller may not see or
        restore there, is only answered."""
        validate_id(checkpoint_id)
        try:
            meta = self._visible(uid, checkpoint_id)
        except (UnknownCheckpoint, AmbiguousId):  # a request for nothing: answered, not counted
            raise
        except StoreError as exc:  # root's entry is there but unreadable
            self._restore_failed(checkpoint_id, exc, uid, cgroup)
            raise
        try:
            target, original = self._target_cgroup(uid, cgroup, meta)
            with self.restore_lock:
                if not force:
                    self._check_guard(meta, target or original)
                result = self.restorer.restore(meta.id, target=target, original=original,
                                               force=force, lazy=lazy)
        except PermissionDenied:
            raise
        except OSError as exc:  # answered as a failure, not a dropped connection
            failed = RestoreFailed(f"restore of {meta.id} failed: {exc}")
            self._restore_failed(meta.id, failed, uid, cgroup or meta.cgroup, meta.uid)
            raise failed from exc
        except OomguardError as exc:
            self._restore_failed(meta.id, exc, uid, cgroup or meta.cgroup, meta.uid)
            raise
        if self.events is not None:
            self.events.publish(RestoreDone(result, requested_by=uid))
        found = {"id": meta.id, "pid": result.pid, "was_pid": meta.pid,
                 "seconds": round(result.seconds, 3),
                 "verify_s": round(result.verify_s, 3), "total_s": round(result.total_s, 3),
                 "lazy": result.lazy, "lazy_fallback": result.lazy_fallback,
                 "warmed_bytes": result.warmed_bytes,
                 "cgroup": result.meta.restored_cgroup}
        if result.gpu_pids or result.gpu_error:
            found.update(gpu_pids=list(result.gpu_pids), gpu_error=result.gpu_error)
        return found

    def _restore_failed(self, checkpoint_id: str, exc: BaseException, requested_by: int,
                        cgroup: str | None, owner: int | None = None) -> None:
        if self.events is not None:
            self.events.publish(RestoreFailedEvent(checkpoint_id, failure_fields(exc), cgroup,
                                                   uid=owner, requested_by=requested_by))

    def _check_guard(self, meta: CheckpointMeta, into: MemoryCgroup | None) -> None:
        """A rule guards the target: the checkpoint must fit under its threshold with the
        rule's restore_margin, as for auto-restore (else NoRoom, with the ways out)."""
        guard = self.guard_of(into) if into is not None and self.guard_of is not None else None
        if guard is None or into is None:
            return
        try:
            snap = into.snapshot()
        except CgroupGone:
            raise RestoreFailed(f"target cgroup {into.path} does not exist") from None
        check_fits(meta.id, into, snap, memory_pages_bytes(self.store, meta.id), guard)

    def checkpoint(self, uid: int, pid: int, reason: str = "on demand",
                   requester: int | None = None) -> dict[str, Any]:
        """`requester`: the asking process (SO_PEERCRED): a tree holding it is refused. A
        process inside an `oomguard exec` job stands for the whole job: its PID namespace's
        init and every process under it (CRIU dumps such a namespace only whole); the reply's
        `asked_pid` is `pid`, its `pid` the tree's root, `job_pid` the job's main process."""
        try:
            tree = tree_of(job_root(self.proc, pid), self.proc)
        except ProcessGone:
            raise ProcessGone(f"no process {pid}") from None
        if uid != ROOT and tree.root.uid != uid:
            whose = "" if tree.root.pid == pid else f" (the init of the job of process {pid})"
            raise PermissionDenied(f"process {tree.root.pid}{whose} is not yours")
        # The whole tree, as CRIU would dump it, before anything is stopped.
        foreign = foreign_task(tree, uid)
        if foreign is not None:
            raise PermissionDenied(foreign)
        # (oomguard itself, what it runs and the requester: the checkpointer's selfguard says so)
        untouchable = untouchable_task(tree, frozenset())
        if untouchable is not None:
            raise CheckpointFailed(f"checkpoint of {pid} refused before stopping it: "
                                   f"{untouchable}", OUTCOME_UNTOUCHED)
        paged = next((t for t in PagedOutRecord(self.store.state).trees()
                      if set(t.pids) & set(tree.pids)), None)
        if paged is not None:  # its stop is oomguard's: a dump would keep it stopped for good
            raise CheckpointFailed(f"checkpoint of {pid} refused before touching it: it is "
                                   f"paged out ({paged.id}); `oomguard resume {paged.id}` "
                                   "first", OUTCOME_UNTOUCHED)
        try:
            rel = self.proc.memory_cgroup(pid)
        except ProcessGone:
            rel = None
        cgroup = open_cgroup(rel, self.layout) if rel and self.layout.memory_mount else None
        headroom = None if uid == ROOT or cgroup is None else self.user_headroom(cgroup)
        try:  # the rights again, on the tree as it stopped (a setuid exec meanwhile)
            result = self.checkpointer.checkpoint(tree, cgroup, reason, headroom=headroom,
                                                  requester=requester,
                                                  rights_of=None if uid == ROOT else uid)
        except TreeNotYours as exc:
            if self.on_event is not None:
                self.on_event("checkpoint.refused_not_yours", pid=tree.root.pid, uid=uid,
                              explanation=str(exc))
            raise PermissionDenied(str(exc)) from None
        finally:
            if self.after_checkpoint is not None:
                self.after_checkpoint()
        t = result.timings
        timings = {"seconds": round(t.total_s, 3), "freeze_s": round(t.freeze_s, 4),
                   "dump_s": round(t.dump_s, 4), "commit_s": round(t.commit_s, 4)}
        if self.events is not None:
            self.events.publish(CheckpointDone(result.meta, t, requested_by=uid))
        return {**asdict(result.meta), **timings, "asked_pid": pid}

    def gpu_resume(self, uid: int, pid: int) -> dict[str, Any]:
        """Put a process's CUDA state back on the GPU after a `vram` action (root, or the
        process's owner)."""
        try:
            owner = self.proc.process(pid).uid
        except ProcessGone:
            raise ProcessGone(f"no process {pid}") from None
        if uid != ROOT and owner != uid:
            raise PermissionDenied(f"process {pid} is not yours")
        gpu = self.checkpointer.gpu
        if gpu is None or not gpu.drives_cuda:
            raise OomguardError("no cuda-checkpoint here: "
                                + (gpu.why if gpu is not None else "GPU support is off"))
        gpu.resume([pid])
        if self.on_event is not None:
            self.on_event("gpu.vram_restored", pid=pid, uid=owner, requested_by=uid)
        return {"pid": pid}

    def prekill(self, cgroup_path: str) -> dict[str, Any]:
        """systemd-oomd is about to kill this cgroup: checkpoint its process trees first,
        largest first. Trees that cannot be checkpointed are left to oomd."""
        try:
            cgroup = open_cgroup(cgroup_path, self.layout)
            members = self.proc.processes(cgroup.procs())
        except (ValueError, CgroupGone) as exc:
            raise OomguardError(f"cgroup {cgroup_path}: {exc}") from None
        protected = own_family(self.proc)
        gpu = self.checkpointer.gpu
        vram = gpu.vram_by_pid() if gpu is not None and gpu.accounting else {}
        prefs = self.prefs_of(cgroup) if self.prefs_of is not None else None
        done, failed = [], []
        sessions = prefs is not None and prefs.take_sessions
        for tree in select_victims(build_trees(members, protected, sessions), vram, prefs):
            try:
                result = self.checkpointer.checkpoint(tree, cgroup, f"systemd-oomd is about to "
                                                      f"kill {cgroup_path}")
                done.append(result.meta.id)
            except (CheckpointFailed, ProcessGone) as exc:
                failed.append(f"{tree.root.pid}: {exc}")
        return {"checkpoints": done, "failed": failed}

    def status(self, uid: int) -> dict[str, Any]:
        status: dict[str, Any] = dict(self._status()) if self._status else {"daemon": False}
        checkpoints = self.store.list()
        mine = [m for m in checkpoints if uid == ROOT or m.uid == uid]
        status["checkpoints"] = {
            "count": len(mine),
            "checkpointed": sum(1 for m in mine if m.state == "checkpointed"),
            "bytes": sum(m.image_bytes for m in mine),
        }
        paged = self.paged_out(uid)
        status["paged_out"] = {"count": len(paged),
                               "bytes": sum(int(t["paged_bytes"]) for t in paged),
                               "ids": [str(t["id"]) for t in paged]}
        budget = self.budget
        if budget is not None:  # the store's use against its budget (oomguard.policy.budget)
            try:
                reading = budget.reading()
                status["store"] = {**reading.fields(), "total": reading.total,
                                   "over": reading.over()}
            except StoreError as exc:
                status["store"] = {"error": str(exc)}
        if uid != ROOT:
            status.pop("recent_events", None)
        return status


def _paged_out_fields(tree: PagedOutTree) -> dict[str, Any]:
    """A paged-out tree as `list` and `show` answer it (`state`: paged-out)."""
    return {**asdict(tree), "tasks": [list(x) for x in tree.tasks], "state": "paged-out",
            "pid": tree.root_pid}
