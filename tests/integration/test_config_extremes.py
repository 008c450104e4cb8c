"""A daemon runs with every duration and size at the edge of what check-config accepts, and a
SIGHUP reload to a value past the edge (which used to crash it) is rejected while it guards on.
check-config, the daemon's start and its reload give the same hints and warnings."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    run_oomguard,
    start_in_cgroup,
)


def test_daemon_runs_at_the_bounds_and_rejects_a_reload_past_them(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("bounds", 256 * MiB)
    config = tmp_path / "bounds.toml"
    edges = ('[daemon]\nrescan_interval = "1d"\npoll_interval = "1h"\nstore_max_age = "3650d"\n'
             'store_max_size = "1P"\n[hooks]\ntimeout = "1d"\non_checkpoint = "true"\n'
             '[criu]\ntimeout = "1d"\n\n'
             f'[[guard]]\ncgroups = ["{cg.path}"]\nrestore_quiet = "1d"\n'
             'post_action_delay = "0"\nkill_grace = "1d"\nfreeze_deadline = "1d"\n'
             'store_margin = "0"\nrestore_margin = "1P"\n')
    config.write_text(edges)
    proc = DaemonProcess(store, tmp_path / "daemon.log", "--config", str(config))
    try:
        proc.wait_event("guard.armed")
        config.write_text(edges.replace('rescan_interval = "1d"', 'rescan_interval = "100000d"')
                          .replace('timeout = "1d"\non_checkpoint', 'timeout = "0"\non_checkpoint'))
        proc.handle.send_signal(signal.SIGHUP)
        rejected = proc.wait_event("config.rejected", timeout=10)[0]
        assert any("daemon.rescan_interval" in issue for issue in rejected["issues"])
        assert any("hooks.timeout" in issue for issue in rejected["issues"])
        # Still alive, still guarding with the old rules: a hog is checkpointed.
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                           count=100_000))
        done = proc.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == hog.pid
        hog.wait(timeout=10)
        assert cg.snapshot().oom_kills == 0
        assert proc.handle.poll() is None
    finally:
        assert proc.stop() == 0


def test_check_config_hints_at_errors_and_warns_of_a_missing_cgroup(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("present", 64 * MiB)
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[[guard]]\ncgroups = ["{cg.path}"]\nthreshold = 85\n'
                   f'[[guard]]\ncgroups = ["{cg.path}"]\ntreshold = "85%"\n')
    refused = run_oomguard(store, "check-config", str(bad), timeout=60)
    assert refused.returncode == 2, refused
    assert refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"oomguard: config error: {bad}: guard[0].threshold: must be above 0% and at most "
        '100%, got 85 (did you mean "85%"?)',
        f"oomguard: config error: {bad}: guard[1].treshold: unknown key "
        "(did you mean 'threshold'?)",
    ]

    absent = f"{cg.path}-absent"
    pattern = f"{cg.path.parent}/oomguard-test-no-such-*"  # a glob matching nothing: no warning
    good = tmp_path / "good.toml"
    good.write_text(f'[[guard]]\ncgroups = ["{cg.path}", "{absent}", "{pattern}"]\n'
                    'threshold = "85%"\n')
    accepted = run_oomguard(store, "check-config", str(good), timeout=60)
    assert accepted.returncode == 0, accepted
    assert accepted.stdout.strip() == f"{good}: OK (1 guard rule(s))"
    assert accepted.stderr.splitlines() == [
        f"warning: {good}: guard[0].cgroups: cgroup {absent} does not exist "
        "(guarded once it is created)"]


def test_daemon_logs_the_warnings_and_refuses_a_reload_with_the_hints(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("warned", 128 * MiB)
    absent = f"{cg.path}-absent"
    config = tmp_path / "warned.toml"
    config.write_text(f'[[guard]]\ncgroups = ["{cg.path}", "{absent}"]\n')
    proc = DaemonProcess(store, tmp_path / "daemon.log", "--config", str(config))
    try:
        [warning] = proc.wait_event("config.warning")
        assert (warning["key"], warning["source"]) == ("guard[0].cgroups", str(config))
        assert f"cgroup {absent} does not exist" in warning["reason"]
        proc.wait_event("guard.armed")

        config.write_text(f'[[guard]]\ncgroups = ["{cg.path}"]\ntreshold = "85%"\n')
        proc.handle.send_signal(signal.SIGHUP)
        [rejected] = proc.wait_event("config.rejected", timeout=10)
        assert rejected["issues"] == [
            f"{config}: guard[0].treshold: unknown key (did you mean 'threshold'?)"]

        config.write_text(f'[[guard]]\ncgroups = ["{cg.path}"]\nheadroom = 64\n')
        proc.handle.send_signal(signal.SIGHUP)
        proc.wait_event("config.reloaded", timeout=10)
        tiny = [e for e in proc.events("config.warning") if e["key"] == "guard[0].headroom"]
        assert [e["reason"] for e in tiny] == ['64 bytes (did you mean "64M"?)']
        assert proc.handle.poll() is None
    finally:
        assert proc.stop() == 0
