"""Whole-tree rights for on-demand checkpoints: every task the caller's (real, effective and
saved uid), none of the tasks the guards never touch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.policy.rights import foreign_task, untouchable_task
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import parse_status
from tests.unit._support import proc_info


def tree(*members: object) -> ProcessTree:
    procs = tuple(members)
    return ProcessTree(root=procs[0], members=procs)  # type: ignore[arg-type]


ALICE = 1000
shell = replace(proc_info(100, uid=ALICE), uids=(ALICE, ALICE, ALICE, ALICE))
job = replace(proc_info(101, 100, uid=ALICE), uids=(ALICE, ALICE, ALICE, ALICE))
sudo = replace(proc_info(102, 100, uid=ALICE, comm="sudo"), uids=(ALICE, 0, 0, 0))
dropped = replace(proc_info(103, 100, uid=ALICE), uids=(ALICE, ALICE, 0, ALICE))
other = replace(proc_info(104, 100, uid=2000), uids=(2000, 2000, 2000, 2000))


@pytest.mark.parametrize(("members", "want"), [
    ((shell, job), None),
    ((shell, job, sudo), "process 102 (sudo) in the tree of 100 holds the rights of uid 0"),
    ((shell, dropped), "process 103 (p103) in the tree of 100 holds the rights of uid 0"),
    ((shell, other), "process 104 (p104) in the tree of 100 runs as uid 2000"),
], ids=["own", "setuid-child", "saved-uid-root", "other-user"])
def test_foreign_task(members: tuple[object, ...], want: str | None) -> None:
    found = foreign_task(tree(*members), ALICE)
    assert (found is None) if want is None else (found is not None and found.startswith(want))


def test_root_may_checkpoint_any_users_tree() -> None:
    assert foreign_task(tree(shell, sudo, other), 0) is None


@pytest.mark.parametrize(("change", "words"), [
    ({"oom_score_adj": -1000}, "oom_score_adj -1000"),
    ({"tracer_pid": 4242}, "traced by process 4242"),
    ({"kernel_thread": True}, "kernel thread"),
], ids=["oom-score-adj", "traced", "kthread"])
def test_untouchable_task(change: dict[str, object], words: str) -> None:
    bad = replace(job, **change)  # type: ignore[arg-type]
    found = untouchable_task(tree(shell, bad), frozenset())
    assert found is not None and words in found and "process 101" in found


def test_oomguards_own_processes_are_untouchable() -> None:
    found = untouchable_task(tree(shell, job), frozenset({101}))
    assert found is not None and "oomguard" in found
    assert untouchable_task(tree(shell, job), frozenset()) is None


def test_status_uids_are_all_read() -> None:
    status = parse_status("Name:\tsudo\nUid:\t1000\t0\t0\t0\nVmRSS:\t 100 kB\n")
    assert status.uid == 1000 and status.uids == (1000, 0, 0, 0)
