"""A job that comes into a cgroup while one of its jobs is dumped is held too (issue 26, found by
the soak): the room lifted for the dump was the newcomer's to take. In the soak a job started
0.1 s into its mate's dump grew to 179 MiB of a 192 MiB cgroup; the dump failed (CRIU's
parasite, short of memory) and the victim was killed to put the limit back. Now what enters the
cgroup after the victim's mates were held is held as well, and continued with them once the
dump is over and the limit is back. Real cgroup, real CRIU, the daemon's own checkpointer; the
newcomer starts once the victim has stopped (on_frozen, which the dump waits for)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.act.frozen import Frozen
from oomguard.lifecycle.checkpoint import tree_of
from tests.helpers import (
    CgroupFactory,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    start_in_cgroup,
    wait_until,
)
from tests.integration.test_early_room import _checkpointer, _grown

pytestmark = pytest.mark.integration


def test_a_job_started_in_the_cgroup_during_a_dump_is_held_until_it_ends(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg, _, victim = _grown(cgroups, tmp_path, "arrivals")
    checkpointer = _checkpointer(store, tmp_path)
    log = tmp_path / "newcomer.log"
    seen: dict[str, object] = {}

    def frozen(stopped: Frozen, at: float) -> None:
        # The victim is stopped and its mates (none here) held: a job starts in the cgroup,
        # as a scheduler or a user at a prompt would start one, and grows fast.
        # (Not this test's child: a checkpoint spares the family of the process carrying it
        # out, which a daemon's jobs never are.)
        starter = start_in_cgroup(cg, ["setsid", "-f", *hog_argv(
            log, target=100, rate=1000, count=100_000, tick=0.02)], cwd=tmp_path)
        assert starter.wait(timeout=30) == 0
        found = wait_until(lambda: [p for p in cg.procs() if p != victim], 10)
        assert found, "the newcomer never came in"
        seen["pid"] = pid = found[0]
        seen["held"] = wait_until(lambda: proc_state(pid) == "T", 10)

    try:
        result = checkpointer.checkpoint(tree_of(victim, checkpointer.proc), cg, "test",
                                         on_frozen=frozen)
        assert result.meta.pid == victim
        newcomer = int(str(seen["pid"]))
        assert seen["held"], "the job that came in during the dump was never held"
        # Continued once the dump was over, and runs on.
        assert wait_until(lambda: proc_state(newcomer) in ("R", "S", "D"), 10), \
            proc_state(newcomer)
        before = last_count(log)
        assert wait_until(lambda: last_count(log) > before, 10)
        assert cg.limit() == 160 * (1 << 20)
    finally:
        kill_pid(victim)
        if "pid" in seen:
            kill_pid(int(str(seen["pid"])))
