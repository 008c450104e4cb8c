"""A daemon runs with every duration and size at the edge of what check-config accepts, and a
SIGHUP reload to a value past the edge (which used to crash it) is rejected while it guards on."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.helpers import CgroupFactory, DaemonProcess, MiB, hog_argv, start_in_cgroup


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
