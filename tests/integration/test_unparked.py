"""What a cgroup's freeze still waits for (the `unparked` of cgroup.frozen), read from a real
cgroup's tasks: a sleeping task is named with where it sleeps, a stopped one counts as parked.
(The v2 freezer's own parking is in the v2 lane: test_v2_only.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from oomguard.respond.actor import unparked
from oomguard.sense.procfs import ProcReader
from tests.helpers import CgroupFactory, MiB, kill_pid, start_in_cgroup, wait_until

pytestmark = pytest.mark.integration


def test_sleeping_tasks_are_named_and_stopped_ones_count_as_parked(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg = cgroups.make("unparked", 64 * MiB)
    sleepers = [start_in_cgroup(cg, ["sleep", "60"]) for _ in range(2)]
    proc = ProcReader()
    try:
        assert wait_until(lambda: {t["pid"] for t in unparked(cg.path, proc)
                                   if t["state"] == "S"} == {s.pid for s in sleepers}, 10), \
            unparked(cg.path, proc)
        told = unparked(cg.path, proc)
        assert all(t["tid"] == t["pid"] and t["wchan"] for t in told), told
        os.kill(sleepers[0].pid, signal.SIGSTOP)
        assert wait_until(lambda: [t["pid"] for t in unparked(cg.path, proc)]
                          == [sleepers[1].pid], 10), unparked(cg.path, proc)
    finally:
        for sleeper in sleepers:
            kill_pid(sleeper.pid)
            sleeper.wait()
    assert wait_until(lambda: unparked(cg.path, proc) == [], 10)


def test_a_cgroup_gone_tells_nothing(tmp_path: Path) -> None:
    """A cgroup removed under the action tells no threads (and raises nothing: the event
    is written whatever it finds)."""
    assert unparked(tmp_path / "no-such-cgroup", ProcReader()) == []
