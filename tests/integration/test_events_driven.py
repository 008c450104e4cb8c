"""The daemon learns of cgroup changes from the kernel, not from a timer: with the safety rescan
an hour away, a cgroup created under a glob is armed (and a hog in it checkpointed), a removed
one is let go, a configured cgroup that appears later is armed, and a limit written by someone
is followed (the thresholds move with it), all within seconds. Real cgroups, real daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.mounts import read_layout
from oomguard.config.loading import load_config
from oomguard.control.realparts import build_checkpointer, build_criu
from oomguard.daemon.guards import CgroupGuard
from oomguard.daemon.loop import Daemon
from oomguard.sense.procfs import ProcReader
from tests.helpers import (
    EMULATION_FACTOR,
    CgroupFactory,
    KeptLog,
    MiB,
    daemon,
    hog_argv,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
NO_RESCAN = '[daemon]\nrescan_interval = "1h"\n\n'


def _made(cgroups: CgroupFactory, parent: MemoryCgroup, name: str) -> MemoryCgroup:
    if parent.version == 2:  # v2: a child has memory files only where the parent delegates it
        control = parent.path / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            control.write_text("+memory")
    child = parent.child(name)
    child.create()
    cgroups.created.append(child)  # removed (after what runs in it) before its parent
    return child


def _child(cgroups: CgroupFactory, parent: MemoryCgroup, name: str, limit: int) -> MemoryCgroup:
    child = _made(cgroups, parent, name)
    child.set_limit(limit)
    return child


def armed_with(guard: Any, path: Path, limit: int, timeout: float = 10) -> dict[str, Any]:
    """The guard.armed event for `path` at `limit`. A cgroup is made (mkdir) before its limit
    is written: the daemon may arm it at once with no limit, then again when the limit file
    is written; the one that counts is the one with the limit."""
    def found() -> dict[str, Any] | None:
        return next((e for e in guard.events("guard.armed")
                     if e["cgroup"] == str(path) and e["limit"] == limit), None)

    event = wait_until(found, timeout * EMULATION_FACTOR)
    assert event, f"{path} not armed at {limit}: {guard.events('guard.armed')}"
    return dict(event)


def test_a_cgroup_created_under_a_glob_is_guarded_at_once(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    jobs = cgroups.make("globjobs", None)
    config = tmp_path / "glob.toml"
    config.write_text(NO_RESCAN + f'[[guard]]\ncgroups = ["{jobs.path}/job_*"]\n'
                      'threshold = "85%"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.started")
        assert guard.events("guard.armed") == []  # nothing matches yet
        job = _child(cgroups, jobs, "job_1", 256 * MiB)
        armed_with(guard, job.path, 256 * MiB)
        hog = start_in_cgroup(job, hog_argv(tmp_path / "hog.log", target=400, rate=200,
                                            count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == hog.pid
        hog.wait(timeout=10)
        job.path.rmdir()
        cgroups.created.remove(job)
        gone = guard.wait_event("guard.cgroup_gone", timeout=10)[0]
        assert gone["cgroup"] == str(job.path)
        again = _child(cgroups, jobs, "job_2", 128 * MiB)
        armed_with(guard, again.path, 128 * MiB)
    assert job.path.exists() is False and again.snapshot().oom_kills == 0


def test_a_configured_cgroup_that_appears_later_is_armed(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    parent = cgroups.make("later", None)
    target = parent.child("build")
    config = tmp_path / "later.toml"
    config.write_text(NO_RESCAN + f'[[guard]]\ncgroups = ["{target.path}"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.cgroup_missing")
        _child(cgroups, parent, "build", 300 * MiB)
        armed_with(guard, target.path, 300 * MiB)


def test_a_limit_written_is_followed_without_a_rescan(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("limitmove", 1024 * MiB)
    config = tmp_path / "limit.toml"
    config.write_text(NO_RESCAN + f'[[guard]]\ncgroups = ["{cg.path}"]\nthreshold = "85%"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        assert guard.wait_event("guard.armed")[0]["limit"] == 1024 * MiB
        cg.set_limit(256 * MiB)
        moved = guard.wait_event("guard.armed", timeout=10, count=2)[1]
        assert moved["limit"] == 256 * MiB
        # The thresholds moved with it: a hog past 85% of the new limit is checkpointed
        # (at the old one it would have been OOM-killed first).
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=200,
                                           count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == hog.pid
        hog.wait(timeout=10)
    assert cg.snapshot().oom_kills == 0


def test_a_configured_cgroup_removed_and_made_again_is_followed(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """kernfs tells a watch inside a removed cgroup nothing: its parent's watch does."""
    parent = cgroups.make("remade", None)
    build = _child(cgroups, parent, "build", 300 * MiB)
    config = tmp_path / "remade.toml"
    config.write_text(NO_RESCAN + f'[[guard]]\ncgroups = ["{build.path}"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        build.path.rmdir()
        assert guard.wait_event("guard.cgroup_gone", timeout=10)[0]["cgroup"] == str(build.path)
        build.create()
        build.set_limit(200 * MiB)
        armed_with(guard, build.path, 200 * MiB)


def test_a_limit_written_after_the_cgroup_was_made_arms_it_at_that_limit(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The race a scheduler makes every time (mkdir, then the limit): armed first with no
    limit, then at the limit once it is written."""
    jobs = cgroups.make("slowlimit", None)
    config = tmp_path / "slow.toml"
    config.write_text(NO_RESCAN + f'[[guard]]\ncgroups = ["{jobs.path}/job_*"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.started")
        job = _made(cgroups, jobs, "job_1")
        first = guard.wait_event("guard.armed", timeout=10)[0]
        assert first["cgroup"] == str(job.path) and first["limit"] is None
        job.set_limit(192 * MiB)
        armed_with(guard, job.path, 192 * MiB)



def test_a_limit_written_while_the_guard_is_being_armed_is_not_missed(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """What the Slurm lane hit: slurmstepd wrote job_1's limit after the daemon had read the
    cgroup (no limit) and before the daemon's inotify watch was on the file. No event came,
    and the file's stamp, taken after the write, never changed again: the job grew to its
    limit unguarded and was OOM-killed. The write is forced into that window here: a real
    daemon arms a real cgroup whose limit is written right after the daemon's read."""
    jobs = cgroups.make("armrace", None)
    job = _made(cgroups, jobs, "job_1")
    path = tmp_path / "race.toml"
    path.write_text(f'[daemon]\nrescan_interval = "1h"\nstore = "{store}"\n\n'
                    f'[[guard]]\ncgroups = ["{jobs.path}/job_*"]\n')
    config = load_config(path)
    layout = read_layout()
    checkpointer = build_checkpointer(config, build_criu(config.criu, layout, ProcReader()))
    log = KeptLog()
    guard_daemon = Daemon(config, checkpointer, layout, log)
    read = guard_daemon.armer.own_snapshot
    written: list[int] = []

    def read_then_the_scheduler_writes(cgroup: MemoryCgroup) -> Any:
        snap = read(cgroup)
        if cgroup.path == job.path and not written:
            job.set_limit(192 * MiB)
            written.append(192 * MiB)
        return snap

    guard_daemon.armer.own_snapshot = read_then_the_scheduler_writes
    try:
        guard_daemon.arm()
        assert written == [192 * MiB]
        armed = [e for e in log.named("guard.armed") if e["cgroup"] == str(job.path)]
        assert [e["limit"] for e in armed] == [192 * MiB], log.seen
        (guard,) = [g for g in guard_daemon.guards
                    if isinstance(g, CgroupGuard) and g.name == str(job.path)]
        assert guard.armed_limit == 192 * MiB and guard.fds  # its threshold mark is in place
    finally:
        guard_daemon.close()
