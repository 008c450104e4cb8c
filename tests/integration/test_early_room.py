"""The room a dump lifts is lifted before its tree is stopped (issue 26, the soak's last loss).

Between a crossing and the victim's SIGSTOP the jobs of its cgroup run on; on cgroup v1 with
oom_kill_disable a charge made inside a system call at the limit (the page cache of a write(2))
fails with ENOMEM where a page fault would wait, and the soak's 1000 MB/s job, writing its log,
filled the last 20 MiB under its limit 70 ms after its crossing, before it was stopped. The
headroom is now lifted once a tree passes the checks made before its stop (before the store's
budget is asked, which may prune), and put back with the dump's own lift, before the tree's
mates go on. A tree refused before its stop lifts nothing; one refused by the store's budget
has its room put back. Real cgroups, real CRIU, the daemon's own checkpointer; a spy reads the
limit as the freeze begins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.act.frozen import Frozen
from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.mounts import read_layout
from oomguard.config.loading import load_config
from oomguard.control.realparts import build_checkpointer, build_criu
from oomguard.lifecycle.checkpoint import Checkpointer, tree_of
from oomguard.model.errors import CheckpointFailed, StoreOverBudget
from oomguard.sense.procfs import ProcReader
from oomguard.store.names import LIFTS_LEDGER
from tests.helpers import (
    CgroupFactory,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
LIMIT = 160 * MiB
HEADROOM = 64 * MiB


def _checkpointer(store: Path, tmp_path: Path, extra: str = "") -> Checkpointer:
    path = tmp_path / "room.toml"
    path.write_text(f'[daemon]\nstore = "{store}"\nnice = 0\n{extra}\n')
    config = load_config(path)
    checkpointer = build_checkpointer(config, build_criu(config.criu, read_layout(),
                                                         ProcReader()))
    checkpointer.headroom = HEADROOM
    return checkpointer


class LimitAtFreeze:
    """Wraps the freezer's freeze(): the cgroup's limit in force as the stop begins."""

    def __init__(self, checkpointer: Checkpointer, cgroup: MemoryCgroup) -> None:
        self.seen: list[int | None] = []
        real = checkpointer.freezer.freeze

        def freeze(pid: int, *args: object, **kwargs: object) -> Frozen:
            self.seen.append(cgroup.limit())
            return real(pid, *args, **kwargs)  # type: ignore[arg-type]
        checkpointer.freezer.freeze = freeze  # type: ignore[method-assign]


def _grown(cgroups: CgroupFactory, tmp_path: Path, name: str, mib: int = 130) -> tuple[
        MemoryCgroup, Path, int]:
    """A job holding `mib` MiB (and its interpreter) of its cgroup's 160, past 85%,
    sitting there; its usage close enough to the limit that a dump needs headroom."""
    cg = cgroups.make(name, LIMIT)
    log = tmp_path / f"{name}.log"
    # Not this test's child (a checkpoint refuses the tree of the process carrying it out):
    # `setsid -f` hands it to init, a session leader of its own, as a service's job is.
    starter = start_in_cgroup(cg, ["setsid", "-f", *hog_argv(log, target=mib, rate=300,
                                                             count=100_000, tick=0.05)],
                              cwd=tmp_path, log=tmp_path / f"{name}.err")
    assert starter.wait(timeout=30) == 0
    assert wait_until(lambda: cg.procs(), 10), "the job never started"
    assert wait_until(lambda: cg.usage() >= (mib - 8) * MiB, 60), cg.usage()
    return cg, log, cg.procs()[0]


def _ledger(store: Path) -> dict[str, object]:
    path = store / LIFTS_LEDGER
    return json.loads(path.read_text() or "{}") if path.exists() else {}


def test_the_headroom_is_there_before_the_stop_and_goes_with_the_dump(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg, log, pid = _grown(cgroups, tmp_path, "earlyroom")
    checkpointer = _checkpointer(store, tmp_path)
    spy = LimitAtFreeze(checkpointer, cg)
    try:
        usage = cg.usage()
        result = checkpointer.checkpoint(tree_of(pid, checkpointer.proc), cg, "test")
        # Lifted before the first SIGSTOP: at least the headroom over what was used then,
        # bounded as a dump's lift is (the own limit and twice the headroom).
        (at_freeze,) = spy.seen
        assert at_freeze is not None and usage + HEADROOM <= at_freeze <= LIMIT + 2 * HEADROOM
        assert result.meta.pid == pid and wait_until(lambda: cg.usage() < 16 * MiB, 30)
        assert cg.limit() == LIMIT and _ledger(store) == {}  # back with the dump's own lift
        assert last_count(log) > 0
    finally:
        kill_pid(pid)


def test_a_tree_refused_before_its_stop_lifts_nothing_and_one_the_store_refuses_puts_it_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg, _, pid = _grown(cgroups, tmp_path, "refusedroom")
    try:
        checkpointer = _checkpointer(store, tmp_path)
        lifted: list[int] = []
        real_lift = checkpointer.lifts.lift

        def lift(cgroup: MemoryCgroup, new_limit: int, cap: int | None = None) -> object:
            lifted.append(new_limit)
            return real_lift(cgroup, new_limit, cap)
        checkpointer.lifts.lift = lift  # type: ignore[assignment,method-assign]
        # Refused before its stop: a tree with a task CRIU would fail on (as a traced one).
        tree = tree_of(pid, checkpointer.proc)
        unfit = type(tree)(root=tree.root, members=tree.members, unfit="pid 1 traces it")
        with pytest.raises(CheckpointFailed, match="refused before stopping"):
            checkpointer.checkpoint(unfit, cg, "test")
        assert lifted == [] and cg.limit() == LIMIT
        # Refused by the store's budget (asked after the lift): the room put back, nothing
        # stopped, nothing left in the ledger.
        small = _checkpointer(store, tmp_path, 'store_max_size = "1M"')
        small.lifts.lift = lift  # type: ignore[assignment,method-assign]
        with pytest.raises(StoreOverBudget):
            small.checkpoint(tree_of(pid, small.proc), cg, "test")
        assert len(lifted) == 1 and lifted[0] > LIMIT
        assert cg.limit() == LIMIT and _ledger(store) == {}
        assert checkpointer.proc.state(pid) != "T"
    finally:
        kill_pid(pid)
