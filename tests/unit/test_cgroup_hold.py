"""The frozen-cgroup hold of a paged-out tree (oomguard.act.cgrouphold), in what this host can
run: which trees it refuses (read from a /proc written here), and that a hold failing halfway
undoes itself (a directory stands in for the cgroup v2 mount, which has no cgroup files). The
real hold, on a real cgroup v2 kernel with a shell's job: tests/integration/test_pageout_shell.py
in the v2 lane."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from oomguard.act.cgrouphold import HOLD_PREFIX, CgroupHold, HoldRefused, unified_path


def _proc(root: Path, pid: int, cgroup: str, tracer: int = 0, v1: bool = False) -> None:
    task = root / str(pid)
    task.mkdir(parents=True)
    lines = ["4:memory:/jobs"] if v1 else []
    if cgroup:
        lines.append(f"0::{cgroup}")
    (task / "cgroup").write_text("\n".join(lines) + "\n")
    (task / "status").write_text(f"Name:\tjob\nState:\tT (stopped)\nTracerPid:\t{tracer}\n")


def test_the_unified_path_is_read_beside_v1_lines() -> None:
    assert unified_path("4:memory:/a\n0::/user.slice/x.scope\n") == "/user.slice/x.scope"
    assert unified_path("4:memory:/a\n") is None


def test_a_tree_in_one_cgroup_is_held_in_a_child_named_for_it(tmp_path: Path) -> None:
    _proc(tmp_path / "proc", 10, "/user.slice/app.scope")
    _proc(tmp_path / "proc", 11, "/user.slice/app.scope")
    holds = CgroupHold(tmp_path / "cg", proc_root=tmp_path / "proc")
    assert holds.planned("po-10-5", [10, 11]) == \
        tmp_path / "cg" / "user.slice" / "app.scope" / f"{HOLD_PREFIX}po-10-5"


@pytest.mark.parametrize("tasks, why", [
    ([(10, "/a", 0), (11, "/b", 0)], "spans 2 cgroups"),
    ([(10, "/a", 0), (11, "/a", 99)], "task 11 is traced (by 99)"),
    ([(10, "", 0)], "task 10 is in no cgroup v2 cgroup"),
    ([], "spans 0 cgroups"),
])
def test_trees_a_frozen_cgroup_cannot_hold_are_refused_with_why(
        tmp_path: Path, tasks: list[tuple[int, str, int]], why: str) -> None:
    for pid, cgroup, tracer in tasks:
        _proc(tmp_path / "proc", pid, cgroup, tracer, v1=True)
    holds = CgroupHold(tmp_path / "cg", proc_root=tmp_path / "proc")
    with pytest.raises(HoldRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
        holds.planned("po-1", [pid for pid, _, _ in tasks])


def test_a_task_gone_before_it_was_looked_at_refuses_the_hold(tmp_path: Path) -> None:
    holds = CgroupHold(tmp_path / "cg", proc_root=tmp_path / "proc")
    with pytest.raises(HoldRefused, match="task 10"):
        holds.planned("po-1", [10])


def test_a_hold_that_fails_halfway_stops_the_tree_again_and_removes_its_cgroup(
        tmp_path: Path) -> None:
    """Here the child has no cgroup.events (a plain directory): the hold cannot see it frozen,
    and must leave the tree as it found it: stopped, the child gone (a cgroup's rmdir takes
    its files with it: shutil.rmtree stands in)."""
    _proc(tmp_path / "proc", 10, "/jobs")
    (tmp_path / "cg" / "jobs").mkdir(parents=True)
    signals: list[tuple[int, int]] = []
    holds = CgroupHold(tmp_path / "cg", proc_root=tmp_path / "proc",
                       kill=lambda pid, sig: signals.append((pid, sig)), rmdir=shutil.rmtree)
    child = holds.planned("po-10-1", [10])
    with pytest.raises(HoldRefused, match="cannot hold the tree"):
        holds.hold(child, [10], 0.1)
    assert signals == [(10, signal.SIGCONT), (10, signal.SIGSTOP)]
    assert not child.exists()


def test_a_cgroup_that_exists_already_is_never_taken_over(tmp_path: Path) -> None:
    _proc(tmp_path / "proc", 10, "/jobs")
    holds = CgroupHold(tmp_path / "cg", proc_root=tmp_path / "proc", kill=lambda p, s: None)
    child = holds.planned("po-10-1", [10])
    child.mkdir(parents=True)
    with pytest.raises(HoldRefused, match="cannot make"):
        holds.hold(child, [10], 0.1)
    assert child.is_dir()  # not ours: left as it was


def test_release_touches_only_oomguards_own_cgroups(tmp_path: Path) -> None:
    holds = CgroupHold(tmp_path)
    with pytest.raises(ValueError, match="not a cgroup oomguard holds"):
        holds.release(tmp_path / "user.slice")
    assert holds.release(tmp_path / f"{HOLD_PREFIX}gone") == []  # a crash before it was made
