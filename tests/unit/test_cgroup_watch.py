"""oomguard.cgroup.watch: what a cgroup offers the daemon, one interface for v1 and v2 (scratch
cgroup trees), and the rule that nothing outside oomguard/cgroup asks which version it has."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from oomguard.cgroup import watch
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.config.loading import GuardConfig
from oomguard.daemon.guards import CgroupGuard
from tests.helpers import REPO
from tests.unit._support import MiB

LIMIT = 256 * MiB
RULE = GuardConfig(cgroups=("x",), psi=False)
PRESSURE = ("some avg10=1.50 avg60=0.20 avg300=0.00 total=1234\n"
            "full avg10=0.75 avg60=0.10 avg300=0.00 total=567\n")


def v1_guard(tmp_path: Path) -> CgroupGuard:
    path = tmp_path / "memory" / "job"
    path.mkdir(parents=True)
    for name, text in (("memory.limit_in_bytes", f"{LIMIT}\n"),
                       ("memory.usage_in_bytes", f"{MiB}\n"), ("cgroup.event_control", ""),
                       ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\n")):
        (path / name).write_text(text)
    return CgroupGuard(spec=RULE, cgroup=V1MemoryCgroup(path, tmp_path / "memory"))


def v2_guard(tmp_path: Path, high: str = "max") -> CgroupGuard:
    path = tmp_path / "unified" / "job"
    path.mkdir(parents=True)
    for name, text in (("memory.max", f"{LIMIT}\n"), ("memory.high", f"{high}\n"),
                       ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"),
                       ("memory.pressure", PRESSURE)):
        (path / name).write_text(text)
    return CgroupGuard(spec=RULE, cgroup=V2MemoryCgroup(path, tmp_path / "unified"))


def test_what_v1_offers(tmp_path: Path) -> None:
    guard = v1_guard(tmp_path)
    assert watch.reports_crossings(guard)
    assert watch.freezable(guard.cgroup) is None and not watch.shields_needed(guard.cgroup)
    assert watch.pressure_avg10(guard.cgroup) is None
    assert watch.saved_key(guard) == guard.name + watch.OOM_KILL_KEY
    assert watch.parks_at_limit(guard) is None  # oomguard has not set oom_kill_disable
    setting = watch.read_setting(guard, LIMIT, dry_run=False)
    assert (setting.now, setting.change) == (0, True)
    assert not watch.read_setting(guard, LIMIT, dry_run=True).change  # a dry run changes nothing


def test_what_v2_offers(tmp_path: Path) -> None:
    guard = v2_guard(tmp_path)
    assert not watch.reports_crossings(guard)  # no usage thresholds: polled...
    guard.replaced.high_set = True
    assert watch.reports_crossings(guard)  # ...unless memory.high is at the threshold
    assert watch.freezable(guard.cgroup) is guard.cgroup and watch.shields_needed(guard.cgroup)
    assert watch.pressure_avg10(guard.cgroup) == 1.5
    (guard.cgroup.path / "memory.pressure").unlink()
    assert watch.pressure_avg10(guard.cgroup) is None
    assert watch.saved_key(guard) == guard.name and watch.parks_at_limit(guard) is None
    assert not watch.shields_needed(None)


@pytest.mark.parametrize(("high", "change"), [("max", True), (str(100 * MiB), False)])
def test_v2_setting_left_alone_where_the_users_high_throttles_first(
        tmp_path: Path, high: str, change: bool) -> None:
    setting = watch.read_setting(v2_guard(tmp_path, high), LIMIT, dry_run=False)
    assert setting.change is change


def test_v2_memory_high_taken_back_by_another_writer(tmp_path: Path) -> None:
    guard = v2_guard(tmp_path)
    assert watch.replaced_setting_file(guard) is None  # nothing of oomguard's there yet
    assert watch.high_taken_back(guard, LIMIT) is None
    assert isinstance(guard.cgroup, V2MemoryCgroup)
    watch.set_high_at_threshold(guard, guard.cgroup, LIMIT, change=True, original=None)
    assert watch.replaced_setting_file(guard) == guard.cgroup.path / "memory.high"
    assert watch.high_taken_back(guard, LIMIT) is None  # ours, at the threshold
    (guard.cgroup.path / "memory.high").write_text(f"{LIMIT}\n")  # Slurm's task/cgroup
    assert watch.high_taken_back(guard, LIMIT) == LIMIT
    (guard.cgroup.path / "memory.high").write_text("max\n")
    assert watch.high_taken_back(guard, LIMIT) == LIMIT
    (guard.cgroup.path / "memory.high").write_text(f"{100 * MiB}\n")  # lower still throttles
    assert watch.high_taken_back(guard, LIMIT) is None
    users = v2_guard(tmp_path / "users", high=str(LIMIT))  # never oomguard's: not watched
    assert watch.high_taken_back(users, LIMIT) is None


def test_v2_memory_high_yielded_to_a_writer_that_keeps_taking_it(tmp_path: Path) -> None:
    guard = v2_guard(tmp_path)
    assert isinstance(guard.cgroup, V2MemoryCgroup)
    high = guard.cgroup.path / "memory.high"
    watch.set_high_at_threshold(guard, guard.cgroup, LIMIT, change=True, original=None)
    high.write_text(f"{LIMIT}\n")  # theirs, once more
    watch.yield_high(guard)
    # Nothing of oomguard's is left there: no watch, nothing to put back, no take-back seen.
    assert watch.replaced_setting_file(guard) is None and watch.claimed_key(guard) is None
    assert watch.high_taken_back(guard, LIMIT) is None
    # Armed again: memory.high is not read as one to change, nor set; the guard is polled.
    assert not watch.read_setting(guard, LIMIT, dry_run=False, ours=True).change
    assert not watch.arm_first(guard, LIMIT, True, None, "some 1 2")
    assert high.read_text() == f"{LIMIT}\n" and not watch.reports_crossings(guard)
    assert "memory.high" not in guard.detection
    assert watch.put_back(guard) == [] and high.read_text() == f"{LIMIT}\n"
    assert guard.replaced == watch.Replaced()  # let go: a cgroup made anew is armed anew
    for fd in guard.fds:
        os.close(fd)


def test_v1_put_back_and_parking(tmp_path: Path) -> None:
    guard = v1_guard(tmp_path)
    assert watch.arm_first(guard, LIMIT, True, 0, "some 1 2")  # later marks follow
    oom_control = guard.cgroup.path / "memory.oom_control"
    assert oom_control.read_text() == "1"
    assert watch.parks_at_limit(guard) is guard.cgroup
    assert watch.claimed_key(guard) == guard.name + watch.OOM_KILL_KEY
    assert watch.put_back(guard) == [guard.name + watch.OOM_KILL_KEY]
    assert oom_control.read_text() == "0" and watch.claimed_key(guard) is None
    assert watch.parks_at_limit(guard) is None
    assert sorted(guard.fds.values()) == [watch.EVENTFD] * 2  # the threshold mark, OOM
    for fd in guard.fds:
        os.close(fd)


def test_v2_put_back(tmp_path: Path) -> None:
    guard = v2_guard(tmp_path)
    assert not watch.arm_first(guard, LIMIT, True, None, "some 1 2")  # no later marks
    high = guard.cgroup.path / "memory.high"
    assert high.read_text() == str(int(LIMIT * RULE.threshold))
    assert watch.claimed_key(guard) == guard.name
    assert watch.put_back(guard) == [guard.name]
    assert high.read_text() == "max" and guard.replaced == watch.Replaced()
    assert list(guard.fds.values()) == [watch.KERNFS]  # memory.events
    for fd in guard.fds:
        os.close(fd)


def test_a_saved_original_goes_back_only_to_its_kind(tmp_path: Path) -> None:
    v1, v2 = v1_guard(tmp_path).cgroup, v2_guard(tmp_path).cgroup
    assert watch.put_back_saved(v1, "x", None) is None  # a memory.high key on a v1 cgroup
    assert watch.put_back_saved(v2, "x" + watch.OOM_KILL_KEY, 1) is None
    assert watch.put_back_saved(v1, "x" + watch.OOM_KILL_KEY, 1) == "oom_kill_disable 1"
    assert watch.put_back_saved(v2, "x", 64 * MiB) == f"memory.high {64 * MiB}"


def test_nothing_outside_the_cgroup_layer_asks_for_a_version() -> None:
    """Issue 17, step 1: a new backend touches oomguard/cgroup, not the guard loop."""
    asking = []
    for source in sorted((REPO / "oomguard").rglob("*.py")):
        if source.parent.name == "cgroup":
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "isinstance" and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & {"V1MemoryCgroup", "V2MemoryCgroup"}:
                    asking.append(f"{source.relative_to(REPO)}:{node.lineno}")
    assert asking == []


def test_v1_arming_adds_the_reclaim_watch_where_the_kernel_has_one(tmp_path: Path) -> None:
    guard = v1_guard(tmp_path)
    (guard.cgroup.path / "memory.pressure_level").write_text("")
    try:
        assert watch.arm_first(guard, LIMIT, change=False, original=None, psi_trigger="")
        assert sorted(guard.fds.values()) == ["eventfd", "eventfd", watch.RECLAIM]
        assert guard.detection == ("v1 memory threshold eventfd + OOM notification + reclaim "
                                   "(vmpressure)")
        # Written last to cgroup.event_control: "<eventfd> <pressure_level fd> low".
        assert (guard.cgroup.path / "cgroup.event_control").read_text().endswith(" low")
        reclaim = next(fd for fd, kind in guard.fds.items() if kind == watch.RECLAIM)
        os.eventfd_write(reclaim, 3)
        assert watch.consume(reclaim, watch.RECLAIM) == 3  # the windows counted
        assert watch.consume(reclaim, watch.RECLAIM) == 1  # none: a spurious wake counts one
    finally:
        for fd in guard.fds:
            os.close(fd)


def test_v1_arming_without_a_reclaim_watch_is_armed_all_the_same(tmp_path: Path) -> None:
    guard = v1_guard(tmp_path)  # no memory.pressure_level
    try:
        assert watch.arm_first(guard, LIMIT, change=False, original=None, psi_trigger="")
        assert sorted(guard.fds.values()) == ["eventfd", "eventfd"]
        assert guard.detection == "v1 memory threshold eventfd + OOM notification"
    finally:
        for fd in guard.fds:
            os.close(fd)
