"""The pageout step's hold (issue 29): on cgroup v2 the paged-out tree is recorded with the
frozen cgroup that will hold it before it is moved there (a crash halfway leaves a record
naming it), and a hold that is refused leaves it recorded as held by SIGSTOP, with why; on v1
it is held by SIGSTOP. The hold itself is a stand-in here (the real one: the v2 lane)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.act.cgrouphold import HoldRefused
from oomguard.respond.pageoutstep import PageoutAction
from oomguard.store.pagedout import PagedOutRecord, PagedOutTree


class Holds:
    def __init__(self, mount: Path, record: PagedOutRecord, refuse: str = "",
                 refuse_plan: str = "") -> None:
        self.mount = mount
        self.record = record
        self.refuse = refuse
        self.refuse_plan = refuse_plan
        self.seen_at_hold: list[PagedOutTree] = []

    def planned(self, name: str, pids: list[int]) -> Path:
        if self.refuse_plan:
            raise HoldRefused(self.refuse_plan)
        return self.mount / "jobs" / f"oomguard-held-{name}"

    def hold(self, child: Path, pids: list[int], timeout: float) -> None:
        self.seen_at_hold = self.record.trees()
        if self.refuse:
            raise HoldRefused(self.refuse)


def _step(tmp_path: Path, version: int, **refusals: str) -> tuple[PageoutAction, Any, Holds]:
    record = PagedOutRecord(tmp_path)
    holds = Holds(tmp_path / "cg", record, **refusals)
    tools = SimpleNamespace(pageout=SimpleNamespace(record=record, holds=lambda mount: holds))
    run = SimpleNamespace(frozen=[10, 11],
                          cgroup=SimpleNamespace(version=version, mount=tmp_path / "cg"))
    return PageoutAction(tools), run, holds  # type: ignore[arg-type]


def _tree() -> PagedOutTree:
    return PagedOutTree(id="po-10-1", root_pid=10, tasks=((10, 1), (11, 2)), uid=0,
                        cgroup="/jobs", since=1.0, paged_bytes=1, resident_bytes=2,
                        command="job")


def test_on_v2_the_hold_is_recorded_before_the_tree_is_moved(tmp_path: Path) -> None:
    action, run, holds = _step(tmp_path, 2)
    tree, why = action._hold(run, _tree())
    child = str(tmp_path / "cg" / "jobs" / "oomguard-held-po-10-1")
    assert [t.hold for t in holds.seen_at_hold] == [child]  # in the record before the move
    assert tree.hold == child and why == ""
    assert holds.record.trees() == [tree]


@pytest.mark.parametrize("refusals, why", [
    ({"refuse": "jobs/oomguard-held-po-10-1 did not freeze within 10 s"}, "did not freeze"),
    ({"refuse_plan": "task 11 is traced (by 9): its tracer holds it"}, "traced"),
])
def test_a_refused_hold_leaves_the_tree_recorded_as_held_by_sigstop_with_why(
        tmp_path: Path, refusals: dict[str, str], why: str) -> None:
    action, run, _ = _step(tmp_path, 2, **refusals)
    tree, stopped_why = action._hold(run, _tree())
    assert tree.hold == "" and why in stopped_why
    assert [t.hold for t in PagedOutRecord(tmp_path).trees()] == [""]


def test_on_v1_the_tree_is_held_by_sigstop(tmp_path: Path) -> None:
    action, run, holds = _step(tmp_path, 1)
    tree, why = action._hold(run, _tree())
    assert tree.hold == "" and "cgroup v1" in why and holds.seen_at_hold == []
    assert PagedOutRecord(tmp_path).trees() == [tree]
