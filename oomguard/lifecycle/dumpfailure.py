"""The errors a failed checkpoint raises once its tree was stopped, in words a person reads
in the event: what became of the process (thawed, or dumped and gone), why, and what was
left (a limit that could not be put back, CUDA state not back on the GPU, a full disk)."""

from __future__ import annotations

from oomguard.model.errors import CheckpointFailed, FailedCheckpoint, StoreOverBudget
from oomguard.policy.budget import BudgetReading
from oomguard.policy.unfit import lasting_failure


def commit_failed(pid: int, checkpoint_id: str, exc: BaseException) -> CheckpointFailed:
    """Dumped, the commit failed: the partial stays, listed as incomplete."""
    return CheckpointFailed(
        f"checkpoint of {pid}: the process was dumped and is gone, but "
        f"the commit failed ({exc}); its images are intact and it is listed as "
        f"incomplete ({checkpoint_id}): it is completed at the daemon's next start "
        "or when restored", FailedCheckpoint.INCOMPLETE)


def dump_failed(pid: int, exc: BaseException, outcome: FailedCheckpoint,
                full: BudgetReading | None, gpu_note: str, busy: str) -> CheckpointFailed:
    """The dump failed (or was refused once stopped): StoreOverBudget where the store's disk
    filled meanwhile (`full`: the budget's figures), else CheckpointFailed, with a lasting
    failure named (a tree CRIU will never take: oomguard.policy.unfit). `busy`: why the limit
    lifted for the dump could not be put back ("" where it was)."""
    busy_note = (f"; the limit lifted for its dump could not be put back: {busy}"
                 if busy else "")
    if full is not None:
        return StoreOverBudget(
            f"checkpoint of {pid} failed: the store's disk filled during "
            f"the dump ({full.describe()}): {exc}{gpu_note}{busy_note}", outcome,
            full.fields(), limit_busy=busy)
    return CheckpointFailed(f"checkpoint of {pid} failed: {exc}{gpu_note}{busy_note}",
                            outcome, lasting=lasting_failure(str(exc)) or "",
                            limit_busy=busy)
