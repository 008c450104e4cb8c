"""`oomguard resume-job`: which checkpoint a requeued Slurm job takes, where it restores it, and
waiting for a process that is not our child; and the subtree a guarded cgroup's victims come
from."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.base import subtree_procs
from oomguard.lifecycle.jobresume import job_checkpoint, resume_job, wait_for_exit
from oomguard.model.errors import CgroupGone, OomguardError
from oomguard.sense.procfs import ProcReader
from tests.unit._support import FakeProc, fake_proc_tree


def cp(checkpoint_id: str, job: int | None, created: float, state: str = "checkpointed",
       ) -> dict[str, Any]:
    return {"id": checkpoint_id, "created": created, "state": state,
            "extra": {"slurm_job_id": job} if job is not None else {}}


def test_newest_waiting_checkpoint_of_this_job() -> None:
    found = [cp("a", 7, 10.0), cp("b", 7, 30.0, "restored"), cp("c", 7, 20.0), cp("d", 8, 40.0),
             cp("e", None, 50.0)]
    assert job_checkpoint(found, 7) == found[2]
    assert job_checkpoint(found, 9) is None


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def test_resume_restores_into_our_own_cgroup(tmp_path: Path) -> None:
    import os
    proc = ProcReader(fake_proc_tree(tmp_path / "proc", [
        FakeProc(os.getpid(), 1, cgroup="0::/system.slice/slurmstepd.scope/job_7/step_batch/"
                                        "user/task_0\n")]))
    calls: list[tuple[str, dict[str, Any]]] = []

    def call(method: str, **p: Any) -> dict[str, Any]:
        calls.append((method, p))
        if method == "List":
            return {"checkpoints": [cp("old", 7, 1.0), cp("new", 7, 2.0)]}
        return {"pid": 4321}

    log = Log()
    assert resume_job(call, 7, proc, log, wait=False) == 4321
    assert calls[1] == ("Restore", {"id": "new", "cgroup": "/system.slice/slurmstepd.scope/"
                                                          "job_7/step_batch/user/task_0"})
    assert log.events[0][0] == "job.resumed"
    with pytest.raises(OomguardError, match="no checkpoint of Slurm job 8"):
        resume_job(call, 8, proc, log, wait=False)


def test_wait_ends_when_the_process_goes_or_its_pid_is_reused(tmp_path: Path) -> None:
    root = fake_proc_tree(tmp_path / "proc", [FakeProc(50, 1, starttime=500)])
    proc = ProcReader(root)
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            shutil.rmtree(root / "50")  # it exits

    wait_for_exit(50, proc, sleep=sleep)
    assert len(naps) == 3
    fake_proc_tree(root, [FakeProc(50, 1, starttime=500)])
    reused: list[float] = []

    def reuse(seconds: float) -> None:
        reused.append(seconds)
        shutil.rmtree(root / "50")
        fake_proc_tree(root, [FakeProc(50, 1, starttime=900)])  # another process, same PID

    wait_for_exit(50, proc, sleep=reuse)
    assert len(reused) == 1
    wait_for_exit(99, proc, sleep=lambda s: pytest.fail("never started"))


def test_subtree_procs_covers_leaf_cgroups(tmp_path: Path) -> None:
    job = tmp_path / "job_7"
    (job / "step_batch" / "user" / "task_0").mkdir(parents=True)
    (job / "step_extern").mkdir()
    (job / "cgroup.procs").write_text("")
    (job / "step_batch" / "user" / "task_0" / "cgroup.procs").write_text("100\n101\n")
    (job / "step_extern" / "cgroup.procs").write_text("200\n")
    assert sorted(subtree_procs(job)) == [100, 101, 200]
    with pytest.raises(CgroupGone):
        subtree_procs(tmp_path / "job_8")
