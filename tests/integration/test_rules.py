"""Rules on the real kernel: two rules with different action chains, a fallback that runs when
the store's disk is full, SIGHUP reload (a bad config keeps the old rules), globbed cgroups."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.store.checkpoints import Store
from tests.helpers import (
    HOG,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    start_in_cgroup,
)

pytestmark = pytest.mark.integration


def _hog_with_outside_peer(cgroup: object, log: Path) -> tuple[subprocess.Popen[bytes],
                                                                 socket.socket]:
    """A hog holding a UNIX stream socket whose peer is outside its tree (this test): CRIU
    cannot dump that, so its checkpoint fails for real."""
    ours, theirs = socket.socketpair()
    cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.path / "cgroup.procs"),  # type: ignore[attr-defined]
           sys.executable, str(HOG), "--log", str(log), "--target", "400", "--rate", "300",
           "--count", "100000"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                            start_new_session=True)
    theirs.close()
    return proc, ours


def test_two_rules_one_checkpoints_one_falls_back_to_kill(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    saved = cgroups.make("saved", 256 * MiB)
    killed = cgroups.make("killed", 256 * MiB)
    config = tmp_path / "two.toml"
    config.write_text(f'[[guard]]\ncgroups = ["{saved.path}"]\nactions = ["checkpoint"]\n\n'
                      f'[[guard]]\ncgroups = ["{killed.path}"]\nactions = ["checkpoint", "kill"]\n'
                      'kill_grace = "1s"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed", count=2)
        good = start_in_cgroup(saved, hog_argv(tmp_path / "good.log", target=400, rate=300,
                                               count=100_000))
        bad, peer = _hog_with_outside_peer(killed, tmp_path / "bad.log")
        try:
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert done["pid"] == good.pid
            assert good.wait(timeout=10) == -signal.SIGKILL
            victim_killed = guard.wait_event("victim.killed", timeout=60)[0]
            assert victim_killed["pid"] == bad.pid
            assert bad.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
            failed = [e for e in guard.events("checkpoint.failed") if e["pid"] == bad.pid]
            assert failed and "criu dump" in failed[0]["error"]
        finally:
            peer.close()
            for proc in (good, bad):
                kill_pid(proc.pid)
                proc.wait()
    assert saved.snapshot().oom_kills == 0 and killed.snapshot().oom_kills == 0
    assert [m.pid for m in Store(store).list()] == [good.pid]


def test_full_store_refuses_the_checkpoint_and_the_fallback_runs(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=700", "tmpfs",
                    str(mount_point)], check=True)
    try:
        cg = cgroups.make("fullstore", 256 * MiB)
        config = tmp_path / "full.toml"
        config.write_text(f'[[guard]]\ncgroups = ["{cg.path}"]\nactions = ["checkpoint", "kill"]\n'
                          'kill_grace = "1s"\n')
        store = mount_point / "store"
        with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
            guard.wait_event("guard.armed")
            hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                               count=100_000))
            refused = guard.wait_event("checkpoint.refused", timeout=60)[0]
            assert "MiB free" in refused["reason"] and refused["pid"] == hog.pid
            killed = guard.wait_event("victim.killed", timeout=30)[0]
            assert killed["pid"] == hog.pid and killed["reason"]
            assert hog.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
        assert cg.snapshot().oom_kills == 0
        assert not Store(store).list() and not Store(store).partials()
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_sighup_reload_rejects_a_bad_config_and_applies_a_good_one(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    first = cgroups.make("first", 256 * MiB)
    second = cgroups.make("second", 256 * MiB)
    config = tmp_path / "reload.toml"
    config.write_text(f'[[guard]]\ncgroups = ["{first.path}"]\n')
    proc = DaemonProcess(store, tmp_path / "daemon.log", "--config", str(config))
    try:
        proc.wait_event("guard.armed")
        config.write_text('[[guard]]\ncgroups = ["relative/oops"]\nthreshold = "180%"\n')
        proc.handle.send_signal(signal.SIGHUP)
        rejected = proc.wait_event("config.rejected", timeout=10)[0]
        assert any("guard[0].threshold" in issue for issue in rejected["issues"])
        assert any("guard[0].cgroups" in issue for issue in rejected["issues"])
        # The old rule still guards: a hog in the first cgroup is checkpointed.
        hog = start_in_cgroup(first, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                              count=100_000))
        done = proc.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == hog.pid
        hog.wait(timeout=10)
        config.write_text(f'[[guard]]\ncgroups = ["{second.path}"]\nthreshold = "70%"\n')
        proc.handle.send_signal(signal.SIGHUP)
        proc.wait_event("config.reloaded", timeout=10)
        armed = proc.wait_event("guard.armed", count=2, timeout=10)[-1]
        assert armed["cgroup"] == str(second.path) and armed["threshold"] == 0.7
        assert proc.handle.poll() is None
    finally:
        assert proc.stop() == 0


def test_globbed_cgroups_are_found_as_they_come(cgroups: CgroupFactory, store: Path,
                                                tmp_path: Path) -> None:
    parent = cgroups.make("jobs", None)
    config = tmp_path / "glob.toml"
    config.write_text(f'[daemon]\nrescan_interval = "300ms"\n\n'
                      f'[[guard]]\ncgroups = ["{parent.path}/job-*"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.started")
        time.sleep(0.5)
        assert not guard.events("guard.armed")
        job = parent.child("job-1")
        job.create()
        job.set_limit(256 * MiB)
        try:
            armed = guard.wait_event("guard.armed", timeout=10)[0]
            assert armed["cgroup"] == str(job.path)
            hog = start_in_cgroup(job, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                                count=100_000))
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert done["pid"] == hog.pid
            hog.wait(timeout=10)
        finally:
            for pid in job.procs():
                kill_pid(pid)
            time.sleep(0.2)
            job.remove()
        guard.wait_event("guard.cgroup_gone", timeout=10)


def test_time_to_limit_acts_before_the_threshold(cgroups: CgroupFactory, store: Path,
                                                 tmp_path: Path) -> None:
    """A fast grower is caught on its forecast: with the threshold at 98% (too late for a
    1 GB/s hog), time_to_limit acts earlier, from the measured growth rate."""
    cg = cgroups.make("ttl", 512 * MiB)
    config = tmp_path / "ttl.toml"
    config.write_text(f'[daemon]\npoll_interval = "20ms"\n\n[[guard]]\ncgroups = ["{cg.path}"]\n'
                      'threshold = "98%"\ntime_to_limit = true\npredict_from = "30%"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=800, rate=1000,
                                           count=100_000, chunk=8))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert hog.wait(timeout=10) == -signal.SIGKILL
    crossed = guard.events("threshold.crossed")[0]
    assert "growing" in crossed["reason"] and "checkpoint takes" in crossed["reason"]
    assert crossed["usage"] < 0.98 * 512 * MiB
    assert done["pid"] == hog.pid
    assert cg.snapshot().oom_kills == 0


def test_dry_run_with_preferences_from_flags_touches_nothing(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Flags build the same rule as a config: --prefer picks the smaller hog (its command line
    matches), and --dry-run only says so; both keep running, nothing is stored."""
    cg = cgroups.make("dry", 512 * MiB)
    big = start_in_cgroup(cg, hog_argv(tmp_path / "big.log", target=300, rate=500,
                                       count=100_000))
    small = start_in_cgroup(cg, hog_argv(tmp_path / "small.log", target=160, rate=500,
                                         count=100_000))
    try:
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path), "--threshold",
                    "70%", "--dry-run", "--prefer", "small\\.log",
                    "--actions", "freeze,checkpoint,kill") as guard:
            chosen = guard.wait_event("victim.chosen", timeout=60)[0]
            assert chosen["pid"] == small.pid and chosen["dry_run"] is True
            assert chosen["actions"] == ["freeze", "checkpoint", "kill"]
            time.sleep(0.5)
            assert not guard.events("victim.frozen") and not guard.events("checkpoint.done")
        assert big.poll() is None and small.poll() is None
        assert not Store(store).list()
    finally:
        for proc in (big, small):
            kill_pid(proc.pid)
            proc.wait()


@pytest.mark.parametrize(("flags", "message"), [
    (["--actions", "checkpoint,explode"], "unknown action 'explode'"),
    (["--actions", "kill,checkpoint"], "'kill' can only be the last action"),
    (["--protect", "("], "bad regular expression"),
])
def test_bad_rule_flags_exit_2(store: Path, tmp_path: Path, flags: list[str],
                               message: str) -> None:
    from tests.helpers import run_oomguard

    result = run_oomguard(store, "run", "--cgroup", "/sys/fs/cgroup/memory/x", *flags,
                          timeout=30)
    assert result.returncode == 2 and message in result.stderr, result.stderr
