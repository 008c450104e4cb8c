"""How each step of a checkpoint is undone (oomguard.lifecycle.checkpoint's steps say what
they did with one of these): told the run, and the request where it needs it; each undoes
once, whatever ended the run, what is left of its thing to undo, and says what a failure's
words need on the run (`busy`, `gpu_note`)."""

from __future__ import annotations

import contextlib
import os

from oomguard.act.bystanders import Bystanders, Held
from oomguard.act.freezer import Freezer
from oomguard.act.oomshield import OomShield
from oomguard.gpu.offload import back_to_gpu, put_back_limit
from oomguard.gpu.runtime import GpuSupport
from oomguard.lifecycle.checkpointrun import CheckpointRequest, CheckpointRun
from oomguard.model.errors import CgroupGone
from oomguard.store.checkpoints import Store
from oomguard.store.ledger import FrozenLedger

# What a checkpoint's steps do, each undone once (oomguard.model.unwind), latest first; the
# limit lifted for the dump before anything else.
LIMIT = "limit lifted for the dump"
RESERVATION = "the store's room reserved"
LEDGER = "crash ledger"
VICTIM = "a victim, never a bystander"
SHIELD = "shielded from the OOM killer"
GPU = "CUDA state off the GPU"
FREEZE = "stopped"
OTHERS = "the cgroup's others held"
TERMINALS = "terminal holders told"
IMAGES = "the checkpoint's directory"


class CheckpointUndo:
    """The undos of one Checkpointer's steps, over its parts."""

    def __init__(self, store: Store, freezer: Freezer, shield: OomShield,
                 bystanders: Bystanders, ledger: FrozenLedger,
                 gpu: GpuSupport | None) -> None:
        self.store = store
        self.freezer = freezer
        self.shield = shield
        self.bystanders = bystanders
        self.ledger = ledger
        self.gpu = gpu

    def put_back_limit(self, run: CheckpointRun) -> None:
        """The limits lifted for the dump, put back (first of all: what was lifted for it is
        never what the tree or the cgroup's others run into). `run.busy`: why not, if not."""
        if run.undo_limit is None:
            return
        try:
            run.busy = run.undo_limit() or ""
        except (OSError, CgroupGone) as exc:
            run.busy = str(exc)
        run.undo_limit = None

    def let_others_go(self, run: CheckpointRun) -> None:
        """The rest of the cgroup continued (once the limit is back)."""
        if run.others.pids:
            self.shield.unshield(run.others.pids)
        self.bystanders.release(run.others)
        run.others = Held()

    def thaw(self, run: CheckpointRun) -> None:
        """Not dumped: the tree continued where it stopped (CRIU resumes a tree it failed to
        dump stopped, as it found it), the tasks the user had stopped left stopped. A rule's
        kill after a failed checkpoint is the action chain's next step (chain.py), never
        decided here. Dumped: nothing is left of it to continue."""
        if not run.dumped:
            self.freezer.thaw(run.frozen.ours)

    def put_back_gpu(self, run: CheckpointRun, failure: BaseException | None) -> None:
        """A failed run's tree, thawed: its CUDA state back on the GPU (what went wrong in
        `run.gpu_note`); then, however it ended, the limit lifted for that state put back."""
        assert run.hold is not None
        if failure is not None and run.stopped and not run.dumped and run.hold.suspended \
                and self.gpu:
            trouble = back_to_gpu(self.gpu, run.hold.pids)
            run.gpu_note = ("; its CUDA state is back on the GPU" if trouble is None else
                            f"; its CUDA state could NOT be put back on the GPU: {trouble}")
        put_back_limit(run.hold)

    def tell_terminals(self, request: CheckpointRequest, run: CheckpointRun) -> None:
        """The terminals' holders told how it ended: dumped (committed or to be), they keep
        the terminal for the restore; else the job runs on there."""
        if not run.dumped:
            run.terminals.failed()  # after the limit: a holder slow to answer holds nothing
            return
        assert run.meta is not None  # described before the dump
        run.terminals.committed(run.checkpoint_id, run.meta.job_command or run.meta.command,
                                request.tree.root.pid)

    def leave_images(self, run: CheckpointRun) -> None:
        """Not dumped: CRIU's log kept for a look, the partial removed. Dumped, whether the
        commit went through or not: the images stay (a failed commit's are listed as
        incomplete, completed at the next start or restore); only the lock is closed."""
        if not run.dumped:
            self.store.keep_failed_log(run.checkpoint_id)  # CRIU's whole story, for a look
            self.store.abort(run.checkpoint_id, run.lock_fd)  # closes the lock, as it goes
            run.lock_fd = None
        if run.lock_fd is not None:
            os.close(run.lock_fd)
            run.lock_fd = None

    def clear_ledger(self, request: CheckpointRequest, run: CheckpointRun) -> None:
        with contextlib.suppress(OSError):
            self.ledger.clear(run.pids + list(request.tree.pids) + run.left)
