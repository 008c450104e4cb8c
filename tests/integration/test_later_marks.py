"""The v1 marks beyond the threshold are registered beside the loop once guards are armed (each
waits for an RCU grace period: at start they would hold READY=1 back by half a second per 1000
cgroups): a guard is armed with its threshold mark and OOM notification, the loop adds the
later marks when they come in, and marks that come in for a guard armed again meanwhile are
closed, not leaked. A real daemon object on real v1 cgroups, its real epoll."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.mounts import read_layout
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.watch import RECLAIM
from oomguard.config.loading import load_config
from oomguard.control.realparts import build_checkpointer, build_criu
from oomguard.daemon.guards import CgroupGuard
from oomguard.daemon.loop import Daemon
from oomguard.sense.procfs import ProcReader
from tests.helpers import EMULATION_FACTOR, CgroupFactory, KeptLog, MiB

pytestmark = pytest.mark.integration


def _daemon(paths: list[Path], store: Path, tmp_path: Path) -> tuple[Daemon, KeptLog]:
    config_file = tmp_path / "marks.toml"
    cgroups = ", ".join(f'"{p}"' for p in paths)
    config_file.write_text(f'[daemon]\nrescan_interval = "1h"\nstore = "{store}"\nnice = 0\n\n'
                           f'[[guard]]\ncgroups = [{cgroups}]\nthreshold = "85%"\n')
    config = load_config(config_file)
    layout = read_layout()
    checkpointer = build_checkpointer(config, build_criu(config.criu, layout, ProcReader()))
    log = KeptLog()
    daemon = Daemon(config, checkpointer, layout, log)
    daemon.max_sleep = 0.2  # a loop turn never waits long, whatever happens
    return daemon, log


def _eventfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
        except OSError:
            continue
    return count


def _turns_until(daemon: Daemon, done: Any, seconds: float = 10) -> bool:
    for _ in range(int(seconds * EMULATION_FACTOR / 0.2) + 1):
        if done():
            return True
        daemon.tick()
    return bool(done())


def _v1_only(cgroup: object) -> None:
    if not isinstance(cgroup, V1MemoryCgroup):
        pytest.skip("cgroup v1 only: v2 has no usage thresholds")


def test_a_guard_is_armed_with_its_threshold_and_its_later_marks_follow(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    jobs = [cgroups.make(f"marks{i}", 256 * MiB) for i in range(3)]
    _v1_only(jobs[0])
    daemon, log = _daemon([job.path for job in jobs], store, tmp_path)
    try:
        daemon.arm()
        guards = [g for g in daemon.guards if isinstance(g, CgroupGuard)]
        assert len(guards) == 3 and len(log.named("guard.armed")) == 3
        # Armed: the threshold mark, the OOM notification and the reclaim count; the later
        # marks are the loop's to add, whether or not their thread is done yet.
        assert all(sorted(g.fds.values()) == ["eventfd", "eventfd", RECLAIM] for g in guards), \
            [g.fds for g in guards]
        assert _turns_until(daemon, lambda: all(len(g.fds) == 5 for g in guards))
        for guard in guards:
            for fd, kind in guard.fds.items():
                assert kind in ("eventfd", RECLAIM) and daemon.registrations.fd_owner[fd] == (guard, kind)
                assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
        assert [e["guards"] for e in log.named("guard.marks_added")] == [3]
        assert log.named("guard.marks_incomplete") == []
    finally:
        daemon.close()


def test_marks_that_come_in_for_a_guard_armed_again_are_closed(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    job = cgroups.make("remarked", 256 * MiB)
    _v1_only(job)
    before = _eventfds()
    daemon, log = _daemon([job.path], store, tmp_path)
    try:
        daemon.arm()
        (guard,) = [g for g in daemon.guards if isinstance(g, CgroupGuard)]
        daemon.later_marks.join()  # the first batch is in, not yet taken by the loop
        assert daemon.later_marks.waiting()
        job.set_limit(300 * MiB)  # inotify: the guard is armed again at the new limit

        def rearmed_with_its_marks() -> bool:
            limits = [e["limit"] for e in log.named("guard.armed")]
            return limits == [256 * MiB, 300 * MiB] and len(guard.fds) == 5 \
                and not daemon.later_marks.waiting()

        assert _turns_until(daemon, rearmed_with_its_marks), (log.seen, guard.fds)
        # The first batch's two marks were closed when they came in stale: the guard holds
        # its threshold, its OOM notification, its reclaim count and the new batch's two
        # marks, the park watchdog its own OOM notification, and nothing else is open.
        assert _eventfds() == before + 5 + len(daemon.park_watch.watching())
    finally:
        daemon.close()
    assert _eventfds() == before
