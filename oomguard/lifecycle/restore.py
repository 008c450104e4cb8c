"""Bringing a checkpoint back: checks first (PIDs free, room in the target cgroup), then CRIU
restore detached in its own session, then SIGCONT (trees are dumped stopped), except the
tasks the user had stopped before the checkpoint: they come back stopped."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.act.criu import RESTORE_PIDFILE, Criu
from oomguard.act.freezer import Freezer, kill_tree
from oomguard.act.frozen import USER_STOPPED_STATE
from oomguard.cgroup.base import MemoryCgroup
from oomguard.gpu.offload import back_to_gpu, restored_host_pids
from oomguard.gpu.runtime import ENGINE_CUDA_CHECKPOINT, GpuSupport
from oomguard.lifecycle import fileids
from oomguard.lifecycle.exitwatch import ExitWatch
from oomguard.lifecycle.fileids import FILES_RECORD
from oomguard.lifecycle.lazyrestore import LazySession, lazy_unavailable
from oomguard.lifecycle.restoreoutcome import RestoreResult, one_line
from oomguard.model.errors import CgroupGone, CriuError, NeverFits, NoRoom, RestoreFailed, StoreError
from oomguard.model.unwind import on_failure, unwinding
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import COMPRESSED, IMAGES, STATE_INCOMPLETE, CheckpointMeta, Store
from oomguard.store.compression import compressed_pages, expand, raw_name
from oomguard.store.criu_hook import drop_cache
from oomguard.store.names import HOOKS_DIR
from oomguard.store.pagemap import small_runs, warm
from oomguard.store.verify import RestoreVerifier
from oomguard.terminal.client import HolderError
from oomguard.terminal.external import TTYS
from oomguard.terminal.leases import TtyLease, gid_of, lease_ttys
from oomguard.terminal.shelljob import SHELL_TTY, images_hold_shell_terminal

# (the checkpoint's cgroup, its id) -> a context giving the cgroup to restore into instead
# (a new systemd scope: oomguard.act.systemdscope.SystemdScopes.holding), or None.
ScopeFor = Callable[[str, str], contextlib.AbstractContextManager[MemoryCgroup | None]]

RESTORE_MARGIN = 32 << 20  # CRIU's restorer and the tasks' first steps need a little room
# A lazy restore warms the page cache with up to this much of the job's smallest runs of memory
# (warm_small_runs). 1 GiB job on this VM, 8 restores each way: the first beat came 8-50 ms
# (median 14) after CRIU returned, 20-110 ms (median 43) without.
WARM_BUDGET = 64 << 20
# What a restore undoes if it fails before the tree runs (oomguard.model.unwind)
VERIFIER, EXPANDED, TERMINALS, LAZY = "verifier", "expanded pages", "terminals", "lazy session"


def memory_pages_bytes(store: Store, checkpoint_id: str) -> int:
    """Bytes of memory the restored tree will hold (CRIU's pages-*.img; compressed ones by
    their size before compression, which meta.json keeps)."""
    images = store.images_of(checkpoint_id)
    plain = sum(p.stat().st_size for p in images.glob("pages-*.img"))
    stored = compressed_pages(images)
    if not stored:
        return plain
    raw = store.get(checkpoint_id).extra.get(COMPRESSED, {})
    return plain + sum(int(raw.get(raw_name(p.name), p.stat().st_size)) for p in stored)


def cgroup_root_arg(cgroup: MemoryCgroup) -> str:
    """CRIU's --cgroup-root for the memory controller (v1 names it; v2 has one hierarchy)."""
    return f"memory:{cgroup.rel_path}" if cgroup.version == 1 else cgroup.rel_path


def warm_small_runs(images: Path, budget: int = WARM_BUDGET) -> int:
    """Before a lazy restore: the job's small runs of memory (stacks, heap, libraries' data,
    checked with the other images just before) are asked into the page cache while CRIU and
    the lazy-pages daemon start, so the job's first faults find them there; the bulk comes from
    the lazy-pages daemon. Best effort: returns the bytes asked for (0 where the pagemaps
    cannot be read: the daemon reads those pages anyway)."""
    try:
        return warm(images, small_runs(images, budget))
    except StoreError:
        return 0


class Restorer:
    def __init__(self, criu: Criu, store: Store, freezer: Freezer,
                 proc: ProcReader | None = None, *, pid_wait: float = 3.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 gpu: GpuSupport | None = None, exits: ExitWatch | None = None,
                 scopes: ScopeFor | None = None) -> None:
        self.criu = criu
        self.scopes = scopes  # a systemd host: a unit's job back into a scope of its own
        self.exits = exits  # the daemon watches restored roots until they exit
        self.gpu = gpu
        self.store = store
        self.freezer = freezer
        self.proc = proc or ProcReader()
        self.pid_wait = pid_wait
        self.clock = clock
        self.wall_clock = wall_clock

    def taken_pids(self, meta: CheckpointMeta) -> list[int]:
        """PIDs CRIU needs that are in use. A tree in its own PID namespace needs none."""
        if meta.pidns:
            return []
        deadline = self.clock() + self.pid_wait
        while True:
            # Dumped tasks stay zombies until their parent reaps them: give that a moment.
            taken = [pid for pid in meta.pids if self.proc.exists(pid)]
            if not taken or self.clock() >= deadline:
                return taken
            time.sleep(0.05)

    def check(self, meta: CheckpointMeta, target: MemoryCgroup | None, force: bool) -> None:
        if meta.state == "restored" and not force:
            raise RestoreFailed(
                f"checkpoint {meta.id} was already restored (pid {meta.restored_pid}); "
                "restoring it twice runs the process twice: pass --force if you mean it")
        taken = self.taken_pids(meta)
        if taken:
            who = []
            for pid in taken:
                try:
                    info = self.proc.process(pid)
                    who.append(f"{pid} ({info.comm}, state {info.state})")
                except Exception:
                    who.append(str(pid))
            raise RestoreFailed(
                f"cannot restore {meta.id}: CRIU restores the original PIDs and "
                f"{', '.join(who)} {'is' if len(who) == 1 else 'are'} in use "
                "(a zombie must first be reaped by its parent). Workloads started with "
                "`oomguard exec -- CMD` run in their own PID namespace and always restore.")
        if target is not None:
            self._check_room(meta, target, force)

    def _check_room(self, meta: CheckpointMeta, target: MemoryCgroup, force: bool) -> None:
        try:
            snap = target.snapshot()
        except CgroupGone:
            raise RestoreFailed(f"target cgroup {target.path} does not exist") from None
        if snap.limit_bytes is None or force:
            return
        need = memory_pages_bytes(self.store, meta.id) + RESTORE_MARGIN
        if need > snap.limit_bytes:
            raise NeverFits(
                f"checkpoint {meta.id} needs {need >> 20} MiB but target cgroup {target.path} "
                f"is limited to {snap.limit_bytes >> 20} MiB: it can never fit there, waiting "
                "would not help. Raise the limit, restore with --cgroup into a bigger one, "
                "or pass --force")
        # Page cache is room: the kernel reclaims it as the restore's pages come in.
        free = snap.limit_bytes - snap.unreclaimable_bytes
        if free < need:
            raise NoRoom(
                f"target cgroup {target.path} has {free >> 20} MiB free under its limit (its "
                f"page cache counted as free) but the checkpoint needs {need >> 20} MiB: the "
                "kernel would OOM-kill it during restore. "
                "Raise the limit, restore with --cgroup into a bigger one, wait until it fits "
                "with --wait, or pass --force")

    def restore(self, checkpoint_id: str, target: MemoryCgroup | None = None,
                original: MemoryCgroup | None = None, force: bool = False,
                lazy: bool = False) -> RestoreResult:
        """Restore into `target` (or the original cgroup, `original` being it when it exists).
        One restore of a checkpoint at a time, whatever the path (Store.restore_lock); its
        state is read again under the lock. `lazy`: the job runs before its memory is in
        (oomguard/lifecycle/lazyrestore.py); eager, saying why, where that cannot be done."""
        try:
            if self.store.get(checkpoint_id).state == STATE_INCOMPLETE:
                self.store.complete(checkpoint_id)  # its commit failed earlier: finish it
            with self.store.restore_lock(checkpoint_id) as lock_fd, \
                    self._scope(checkpoint_id, target) as scope:
                if scope is not None:  # into a new scope, not the unit's old cgroup
                    target, original = scope, None
                return self._restore(checkpoint_id, target, original, force,
                                     lock_fd if lazy else None)
        except StoreError as exc:
            raise RestoreFailed(str(exc)) from exc

    def _scope(self, checkpoint_id: str,
               target: MemoryCgroup | None) -> contextlib.AbstractContextManager[
                   MemoryCgroup | None]:
        """Where no cgroup was asked for: a new systemd scope when the checkpoint left a
        unit (oomguard/act/systemdscope.py), else None."""
        if target is not None or self.scopes is None:
            return contextlib.nullcontext(None)
        meta = self.store.get(checkpoint_id)
        if meta.cgroup_version != 2 or not meta.cgroup:
            return contextlib.nullcontext(None)
        return self.scopes(meta.cgroup, meta.id)

    def _restore(self, checkpoint_id: str, target: MemoryCgroup | None,
                 original: MemoryCgroup | None, force: bool,
                 lazy_lock: int | None) -> RestoreResult:
        meta = self.store.get(checkpoint_id)
        self.check(meta, target or original, force)
        images = self.store.path_of(checkpoint_id) / IMAGES
        packed = compressed_pages(images)
        lazy_fallback = None if lazy_lock is None else self._why_not_lazy(packed)
        lazy = lazy_lock is not None and lazy_fallback is None
        verify_start = self.clock()
        work_dir = self.store.path_of(checkpoint_id)
        # All but the pages first (a few KiB: read before the disk is busy with the pages),
        # then the pages are read and checked from now on, while the checks below and CRIU's
        # start go on: CRIU finds them in the page cache, or reads them in alongside. (Lazily:
        # the keeper checks the pages as they stream in.)
        with unwinding() as undos:
            verifier = self._start_verifier(checkpoint_id, images, work_dir,
                                            pages=not lazy and not packed)
            undos.did(VERIFIER, lambda failure: _stop_verifier(verifier, failure))
            warmed = warm_small_runs(images) if lazy else 0
            session: LazySession | None = None
            if packed:  # verified as they are expanded: no pages left to check behind CRIU
                expanded = self._expand(checkpoint_id, packed, verifier)
                # CRIU has read them (or failed): only the .zst is kept
                undos.did(EXPANDED, lambda _failure: _unlink_all(expanded))
            self._check_files(meta, force)
            start = self.clock()
            since = self.exits.expect(self.criu.options.timeout) if self.exits is not None else 0
            ttys = self._lease_ttys(checkpoint_id, meta, images)
            # On any failure from here (CRIU's, an OSError of the hook's, a damaged page), the
            # old holders stay pinned to the checkpoint and the new ones end.
            undos.did(TERMINALS, on_failure(ttys.failed))
            if lazy and lazy_lock is not None:
                session = self._start_lazy(meta.id, images, work_dir, lazy_lock)
                undos.did(LAZY, on_failure(session.abort))
            pid = self._run_criu(meta, images, work_dir, target, ttys, verifier, session)
            report = verifier.finish(cancel=True)  # done by now
        ttys.succeeded()
        _record_ttys(meta, ttys)
        still, gpu_pids, gpu_error = self._let_run(meta, pid)
        running = self.clock()  # the tree runs
        seconds = running - start
        # Reading the images charged their page cache to the target cgroup: give it back
        # (lazily, the keeper does once every page is in). They were not written: no sync.
        if session is None:
            with contextlib.suppress(OSError):
                drop_cache([str(path) for path in images.iterdir() if path.is_file()])
        self._mark_restored(meta, pid, target or original)
        if self.exits is not None:
            self.exits.watch(meta.id, pid, since)
        if session is not None:
            session.hand_over(pid)  # the keeper holds the lock from here until all is in
        return RestoreResult(meta=meta, pid=pid, seconds=seconds, lazy=lazy,
                             lazy_fallback=lazy_fallback, warmed_bytes=warmed,
                             verify_s=report.upfront_s + report.pages_s,
                             total_s=running - verify_start,
                             gpu_pids=tuple(gpu_pids), gpu_error=gpu_error,
                             stopped_pids=tuple(sorted(still)))

    def _why_not_lazy(self, packed: list[Path]) -> str | None:
        """Why a lazy restore asked for runs eagerly (None: it can run lazily)."""
        if packed:
            return "its pages are compressed: they are expanded before CRIU reads them"
        return lazy_unavailable(self.criu)

    def _lease_ttys(self, checkpoint_id: str, meta: CheckpointMeta,
                    images: Path) -> TtyLease:
        """The job's terminals, leased from their holders for CRIU's restore."""
        try:
            return lease_ttys(self._terminals(meta, images), meta.id, meta.uid,
                              gid_of(meta.uid))
        except (HolderError, OSError, ValueError, KeyError) as exc:
            raise RestoreFailed(f"cannot restore {checkpoint_id}: no terminal for the job "
                                f"({exc}); the checkpoint is intact") from exc

    def _let_run(self, meta: CheckpointMeta,
                 pid: int) -> tuple[set[int], list[int], str | None]:
        """The restored tree thawed, but for the tasks its user had stopped (they stay
        stopped), and its CUDA state back on the GPU. Returns the tasks left stopped, and
        the GPU's pids and error."""
        restored = self.proc.descendants(pid)
        keep = self._user_stopped(meta, restored)
        self.freezer.thaw([p for p in restored if p not in keep])
        still = {p.pid for p in self.proc.processes(sorted(keep))
                 if p.state == USER_STOPPED_STATE}
        gpu_pids, gpu_error = self._back_to_gpu(meta, restored)
        return still, gpu_pids, gpu_error

    def _mark_restored(self, meta: CheckpointMeta, pid: int,
                       into: MemoryCgroup | None) -> None:
        meta.state = "restored"
        meta.restored_at = self.wall_clock()
        meta.restored_pid = pid
        meta.exited_at, meta.exit_status, meta.exit_signal = None, None, None  # a new run
        meta.restored_cgroup = into.rel_path if into is not None else None
        self.store.update(meta)

    def _start_verifier(self, checkpoint_id: str, images: Path, work_dir: Path,
                        pages: bool = True) -> RestoreVerifier:
        try:
            sums_file, algorithm, expected = self.store.sums_of(checkpoint_id)
            verifier = RestoreVerifier(images, algorithm, expected, sums_file.name,
                                       clock=self.clock)
            verifier.check_upfront()  # before CRIU sees any of it
            if pages:
                verifier.start(work_dir)
        except StoreError as exc:
            raise RestoreFailed(f"refusing to restore {checkpoint_id}: {exc}") from exc
        except OSError as exc:
            raise RestoreFailed(f"cannot restore {checkpoint_id}: {exc}") from exc
        return verifier

    def _expand(self, checkpoint_id: str, packed: list[Path],
                verifier: RestoreVerifier) -> list[Path]:
        expanded: list[Path] = []
        try:
            for stored in packed:
                expanded.append(expand(stored, verifier.expected[stored.name],
                                       verifier.algorithm))
        except (StoreError, OSError, KeyError) as exc:
            for path in expanded:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise RestoreFailed(f"refusing to restore {checkpoint_id}: {exc}") from exc
        return expanded

    def _start_lazy(self, checkpoint_id: str, images: Path, work_dir: Path,
                    lock_fd: int) -> LazySession:
        try:
            return LazySession.start(self.criu, images, work_dir, lock_fd)
        except (CriuError, OSError) as exc:
            detail = one_line(exc) if isinstance(exc, CriuError) else str(exc)
            raise RestoreFailed(f"cannot restore {checkpoint_id} lazily: {detail}; the "
                                "checkpoint is intact (restore it without --lazy)") from exc

    def _run_criu(self, meta: CheckpointMeta, images: Path, work_dir: Path,
                  target: MemoryCgroup | None, ttys: TtyLease,
                  verifier: RestoreVerifier, session: LazySession | None = None) -> int:
        """CRIU's restore; its post-restore action waits for the pages' verdict (eagerly).
        Returns the restored root's pid."""
        try:
            hook = self.criu.install_hook(self.store.state / HOOKS_DIR)
            pid = self.criu.restore(images, work_dir,
                                    cgroup_root_arg(target) if target is not None else None,
                                    hook, ttys.args, ttys.pass_fds(),
                                    keep_stopped=meta.stopped_nspids,
                                    env=verifier.gate_env(), lazy=session is not None,
                                    wrapper=ttys.wrapper(work_dir / RESTORE_PIDFILE))
        except CriuError as exc:  # (the terminals and the lazy session are undone after)
            report = verifier.finish(cancel=True)
            if report.problems:
                raise RestoreFailed(
                    f"refusing to restore {meta.id}: {verifier.damage(report)} (found while "
                    "CRIU read it: the restored tree was killed before it ran); the checkpoint "
                    "is untouched") from exc
            raise RestoreFailed(f"criu restore of {meta.id} failed; the checkpoint is "
                                f"intact: {one_line(exc)}") from exc
        report = verifier.finish()
        if report.problems:  # the gate cannot have said yes: never let such a tree run on
            kill_tree(self.proc.descendants(pid))
            raise RestoreFailed(f"refusing to restore {meta.id}: "
                                f"{verifier.damage(report)}; the restored tree was killed")
        return pid

    @staticmethod
    def _terminals(meta: CheckpointMeta, images: Path) -> dict[str, Any]:
        """The terminals to give the job: as meta.json records them; a checkpoint of a job
        typed at a shell prompt taken before it recorded one is found in its images."""
        if SHELL_TTY in meta.extra or meta.extra.get(TTYS) \
                or not images_hold_shell_terminal(images):
            return meta.extra
        return {**meta.extra, SHELL_TTY: {"key": None, "index": None, "socket": None}}

    def _user_stopped(self, meta: CheckpointMeta, restored: list[int]) -> set[int]:
        """Host pids of the restored tasks the user had stopped (the hook continues one whose
        process group CRIU's exit would otherwise hang up: the kernel would continue it)."""
        if not meta.stopped_nspids:
            return set()
        infos = self.proc.processes(restored)
        return set(restored_host_pids(meta.stopped_nspids, infos, meta.pidns)) & set(restored)

    def _check_files(self, meta: CheckpointMeta, force: bool) -> None:
        """Each file the tree had open must still be the same file: CRIU opens them by path,
        as root. A non-root user's checkpoint is never restored onto another file (a swapped
        path could hand their process a root-only file); root may --force its own."""
        record = self.store.path_of(meta.id) / FILES_RECORD
        try:
            files = fileids.from_json(record.read_text()) if not record.is_symlink() else None
        except FileNotFoundError:
            return  # a checkpoint from before the record was kept
        except (OSError, ValueError) as exc:
            raise RestoreFailed(f"refusing to restore {meta.id}: its {FILES_RECORD} is "
                                f"unreadable ({exc})") from exc
        if files is None:
            raise RestoreFailed(f"refusing to restore {meta.id}: its {FILES_RECORD} is a "
                                "symlink")
        problems = fileids.changed(files)
        if problems and (meta.uid != 0 or not force):
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            hint = "" if meta.uid != 0 else "; --force restores it anyway"
            raise RestoreFailed(f"refusing to restore {meta.id}: {problems[0]}{more}: the "
                                "restored process would get a file its owner did not have; "
                                f"the checkpoint is intact{hint}")

    def _back_to_gpu(self, meta: CheckpointMeta, restored: list[int],
                     ) -> tuple[list[int], str | None]:
        """cuda-checkpoint took the CUDA state off the GPU before the dump: put it back."""
        if not meta.gpu_pids or meta.gpu_engine != ENGINE_CUDA_CHECKPOINT:
            return [], None
        host = restored_host_pids(meta.gpu_pids, self.proc.processes(restored), meta.pidns)
        if self.gpu is None or not self.gpu.drives_cuda:
            why = self.gpu.why if self.gpu is not None else "GPU support is off"
            return host, (f"the CUDA state of pid(s) {', '.join(map(str, host))} stays in host "
                          f"memory, locked: no cuda-checkpoint here ({why}); run "
                          "`cuda-checkpoint --action restore` then `--action unlock` on each")
        return host, back_to_gpu(self.gpu, host)


def _stop_verifier(verifier: RestoreVerifier, failure: BaseException | None) -> None:
    """The verifier's reading stopped; after a failure, what it read in (charged to us) is
    dropped from the page cache."""
    if failure is not None:
        with contextlib.suppress(OSError):
            drop_cache([str(path) for path in verifier.pages()])
    verifier.finish(cancel=True)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def _record_ttys(meta: CheckpointMeta, ttys: TtyLease) -> None:
    """Where the restored job's terminals are now, kept in its meta.json."""
    if ttys.entries:
        meta.extra[TTYS] = ttys.entries
    if ttys.shell_entry() is not None:
        meta.extra[SHELL_TTY] = ttys.shell_entry()
