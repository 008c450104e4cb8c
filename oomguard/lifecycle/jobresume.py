"""`oomguard resume-job`: the job side of a Slurm requeue. In the requeued job's batch script
it finds the newest checkpoint of this job ($SLURM_JOB_ID) in the store, restores it into the
cgroup this script runs in (the new allocation's: its limit, its node), and waits for the
restored program to end, so the batch step lasts as long as the program.

Limits: the restored program must find the same files and binaries (a shared filesystem), a
CPU with the features it was started on, and, for a tree outside its own PID namespace, its
PIDs free on this node (start jobs with `oomguard exec -- CMD` to lift that one)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from oomguard.model.errors import OomguardError, ProcessGone
from oomguard.sense.procfs import ProcReader


def job_checkpoint(checkpoints: list[dict[str, Any]], job_id: int) -> dict[str, Any] | None:
    """The newest checkpoint of this job that has not been restored yet."""
    mine = [c for c in checkpoints if (c.get("extra") or {}).get("slurm_job_id") == job_id
            and c.get("state") == "checkpointed"]
    return max(mine, key=lambda c: float(c.get("created") or 0)) if mine else None


def wait_for_exit(pid: int, proc: ProcReader, *, poll: float = 0.5,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """Until `pid` (not our child: CRIU restored it) is gone; a reused PID counts as gone."""
    try:
        start = proc.process(pid).starttime
    except ProcessGone:
        return
    while True:
        try:
            info = proc.process(pid)
        except ProcessGone:
            return
        if info.starttime != start or info.state in ("Z", "X"):
            return
        sleep(poll)


def resume_job(call: Callable[..., dict[str, Any]], job_id: int, proc: ProcReader,
               log: Any, *, wait: bool = True) -> int:
    """Returns the restored root's PID. Raises OomguardError when there is nothing to do."""
    found = job_checkpoint(call("List")["checkpoints"], job_id)
    if found is None:
        raise OomguardError(f"no checkpoint of Slurm job {job_id} waiting in the store")
    cgroup = proc.memory_cgroup(os.getpid())
    result = call("Restore", id=found["id"], cgroup=cgroup)
    pid = int(result["pid"])
    log.info("job.resumed", job_id=job_id, id=found["id"], pid=pid, cgroup=cgroup)
    if wait:
        wait_for_exit(pid, proc)
        log.info("job.finished", job_id=job_id, pid=pid)
    return pid
