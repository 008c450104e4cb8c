"""What the daemon says (issue 14): failed restores visible in the log, the metrics and
`status`; one start-up line per guard; a dry run that logs a decision once, not at every poll.
Real daemon, real cgroups, real CRIU, real jobs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.config.loading import GpuConfig
from oomguard.control.client import ControlClient
from oomguard.control.realparts import build_gpu
from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

# A job that counts into a log it keeps open: moved away, CRIU cannot restore it.
COUNTING_JOB = """
import sys, time
log = open(sys.argv[1], "a", buffering=1)
count = 0
while True:
    count += 1
    log.write(f"{count}\\n")
    time.sleep(0.05)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _restores(port: int) -> dict[tuple[str, str], float]:
    """oomguard_restores_total by (outcome, auto), scraped from the daemon's endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "oomguard_restores_total":
                found[(sample.labels["outcome"], sample.labels["auto"])] = sample.value
    return found


def cli(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "oomguard", "--socket", str(sock), "--log-format", "json",
            *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def _recent(guard: DaemonProcess, event: str) -> list[dict[str, Any]]:
    with ControlClient(guard.socket) as client:
        status = client.call("Status")["status"]
    return [e for e in status["recent_events"] if e["event"] == event]


def _checkpointed_job(guard: DaemonProcess, cg: Any, log: Path) -> str:
    job = start_in_cgroup(cg, [sys.executable, "-c", COUNTING_JOB, str(log)])
    assert wait_until(lambda: last_count(log) > 5, 20)
    done = cli(guard.socket, "checkpoint", str(job.pid))
    assert done.returncode == 0, done.stderr
    assert job.wait(timeout=10) == -signal.SIGKILL
    return done.stdout.strip()


def test_failed_restores_through_the_daemon_are_logged_counted_and_in_status(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A restore CRIU cannot do (the job's open log moved away) and one of a damaged image
    (integrity check), both asked through the daemon: each gives restore.failed with the cause
    (CRIU's own line; the checksum mismatch), counts in oomguard_restores_total{outcome=
    "failed"} and shows in `status`'s recent events."""
    cg = cgroups.make("failed", None)
    log = tmp_path / "job.log"
    port = _free_port()
    config = tmp_path / "metrics.toml"
    config.write_text(f"[daemon]\nmetrics_port = {port}\n")
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.started")
        assert wait_until(guard.socket.exists, 10)
        checkpoint_id = _checkpointed_job(guard, cg, log)

        log.rename(tmp_path / "job.log.aside")
        failed = cli(guard.socket, "restore", checkpoint_id)
        assert failed.returncode == 1
        event = guard.wait_event("restore.failed")[0]
        assert event["id"] == checkpoint_id and event["auto"] is False
        assert "job.log" in event["error"] and "criu restore" in event["error"]
        assert "job.log" in event["criu_error"]  # CRIU's own line, on its own
        assert wait_until(lambda: _restores(port).get(("failed", "false")) == 1, 10)
        assert [e["id"] for e in _recent(guard, "restore.failed")] == [checkpoint_id]

        (tmp_path / "job.log.aside").rename(log)
        pages = sorted((store / checkpoint_id / "images").glob("pages-*.img"))[0]
        with pages.open("r+b") as handle:
            byte = handle.read(1)
            handle.seek(0)
            handle.write(bytes([byte[0] ^ 0xFF]))
        damaged = cli(guard.socket, "restore", checkpoint_id)
        assert damaged.returncode == 1
        second = guard.wait_event("restore.failed", count=2)[1]
        assert f"{pages.name} checksum mismatch" in second["error"]
        assert wait_until(lambda: _restores(port).get(("failed", "false")) == 2, 10)
        assert len(_recent(guard, "restore.failed")) == 2

        (store / checkpoint_id / "meta.json").write_text("{damaged")
        unreadable = cli(guard.socket, "restore", checkpoint_id)
        assert unreadable.returncode == 1
        third = guard.wait_event("restore.failed", count=3)[2]
        assert third["id"] == checkpoint_id and "meta.json" in third["error"]
        assert wait_until(lambda: _restores(port).get(("failed", "false")) == 3, 10)
        assert len(_recent(guard, "restore.failed")) == 3
        assert _restores(port).get(("done", "false"), 0) == 0


def test_a_failed_auto_restore_is_logged_counted_and_in_status(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The daemon's own restore (auto_restore) that CRIU cannot do: restore.failed with
    auto=true and CRIU's line, the metric with auto="true", and the status entry."""
    cg = cgroups.make("autofail", 512 * MiB)
    log = tmp_path / "job.log"
    port = _free_port()
    config = tmp_path / "auto.toml"
    config.write_text(f'[daemon]\nmetrics_port = {port}\nrescan_interval = "500ms"\n\n'
                      f'[[guard]]\ncgroups = ["{cg.path}"]\nauto_restore = true\n'
                      f'restore_quiet = "5s"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        assert wait_until(guard.socket.exists, 10)
        os.makedirs(tmp_path / "aside", exist_ok=True)
        job = start_in_cgroup(cg, [sys.executable, "-c", COUNTING_JOB, str(log)])
        assert wait_until(lambda: last_count(log) > 5, 20)
        done = cli(guard.socket, "checkpoint", str(job.pid))
        assert done.returncode == 0, done.stderr
        # Moved well within restore_quiet: the auto-restore finds it gone.
        log.rename(tmp_path / "aside" / "job.log")
        assert job.wait(timeout=10) == -signal.SIGKILL  # reaped: its pid is free again
        event = guard.wait_event("restore.failed", timeout=60)[0]
        assert event["auto"] is True and event["id"] == done.stdout.strip()
        assert "job.log" in event["error"] and "job.log" in event["criu_error"]
        assert wait_until(lambda: _restores(port).get(("failed", "true")) == 1, 10)
        assert [e["auto"] for e in _recent(guard, "restore.failed")] == [True]


# A dry run at a condition nothing ends: a system floor above all the memory there is, or a
# cgroup rule (polled) whose threshold its job is always over.
DRY_RULES = {
    "system": '[[guard]]\nsystem = true\nmin_available = 0.99\nvictim_cgroups = ["{cg}"]\n',
    "cgroup": '[[guard]]\ncgroups = ["{cg}"]\nthreshold = 0.05\nevents = false\n',
}


@pytest.mark.parametrize("rule", sorted(DRY_RULES))
def test_a_dry_run_says_a_lasting_decision_once(cgroups: CgroupFactory, store: Path,
                                                tmp_path: Path, rule: str) -> None:
    """Decided at every poll (ten a second), said once: one threshold.crossed and one
    victim.chosen, with the victim's command line and RSS in MiB, over three seconds."""
    cg = cgroups.make(f"dry-{rule}", 256 * MiB)
    log = tmp_path / "hog.log"
    job = start_in_cgroup(cg, hog_argv(log, target=48, rate=500, count=1_000_000))
    config = tmp_path / "dry.toml"
    config.write_text('[daemon]\npoll_interval = "100ms"\ndry_run = true\n\n'
                      + DRY_RULES[rule].format(cg=cg.path))
    try:
        assert wait_until(lambda: last_count(log) > 5, 20)
        with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
            chosen = guard.wait_event("victim.chosen", timeout=30)[0]
            time.sleep(3)  # thirty polls, all at the same condition
            assert len(guard.events("victim.chosen")) == 1, guard.log.read_text()[-3000:]
            assert len(guard.events("threshold.crossed")) == 1
        assert chosen["pid"] == job.pid and chosen["dry_run"] is True
        assert chosen["command"] == " ".join(hog_argv(log, target=48, rate=500,
                                                      count=1_000_000))
        assert 40 <= chosen["rss_mib"] <= 80
        assert job.poll() is None and not Store(store).list()
    finally:
        kill_pid(job.pid)
        job.wait()


def test_start_up_says_each_guard_the_gpu_and_where_metrics_are(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """One line per guard in words (what, at what level, how detected), the GPU in a few
    words (no probe text where there is no driver), the metrics address once it listens; and
    a checkpoint's event says how to bring it back."""
    limited = cgroups.make("startup-limited", 200 * MiB)
    unlimited = cgroups.make("startup-unlimited", None)
    port = _free_port()
    config = tmp_path / "startup.toml"
    config.write_text(f"[daemon]\nmetrics_port = {port}\n\n"
                      f'[[guard]]\ncgroups = ["{limited.path}"]\nthreshold = 0.85\n\n'
                      f'[[guard]]\ncgroups = ["{unlimited.path}"]\n\n'
                      f'[[guard]]\nsystem = true\nmin_available = 0.01\n'
                      f'victim_cgroups = ["{unlimited.path}"]\n')
    gpu = build_gpu(GpuConfig())
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        armed = {e["cgroup"]: e["summary"] for e in guard.wait_event("guard.armed", count=3)}
        how = ("v1 memory threshold eventfd + OOM notification"
               if isinstance(limited, V1MemoryCgroup) else "memory.high at 85% + memory.events")
        assert armed[str(limited.path)].startswith(
            f"guarding {limited.path}: act (checkpoint, then pageout) at 85% of 200 MiB (170 MiB), {how}")
        assert armed[str(unlimited.path)] == (
            f"guarding {unlimited.path}: no memory limit: nothing to act on until one is set")
        assert armed["system"].startswith("guarding the system: act (checkpoint, then pageout) when "
                                          "MemAvailable is at or below 1% of ")
        assert f"on processes in {unlimited.path}, MemAvailable" in armed["system"]

        started = guard.events("guard.started")[0]
        if not gpu.accounting and "NVML error 12" in gpu.why:  # no NVIDIA driver here
            assert started["gpu"] == "none (no NVIDIA driver)" and "gpu_detail" not in started
            assert "NVML" not in guard.log.read_text()
        listening = guard.wait_event("metrics.listening")[0]
        assert listening["address"] == f"127.0.0.1:{port}"

        def scraped() -> bytes:
            with urllib.request.urlopen(listening["url"], timeout=5) as reply:
                return bytes(reply.read())

        assert wait_until(lambda: b"oomguard_guards 3.0" in scraped(), 10)  # it answers there

        hog = start_in_cgroup(limited, hog_argv(tmp_path / "hog.log", target=180, rate=300,
                                                count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert hog.wait(timeout=20) == -signal.SIGKILL
        assert done["restore"] == f"oomguard restore {done['id']}"
        job = start_in_cgroup(unlimited, [sys.executable, "-c", COUNTING_JOB,
                                          str(tmp_path / "job.log")])
        assert wait_until(lambda: last_count(tmp_path / "job.log") > 3, 20)
        asked = cli(guard.socket, "checkpoint", str(job.pid))
        assert asked.returncode == 0, asked.stderr
        job.wait(timeout=10)
        on_demand = guard.wait_event("checkpoint.done", count=2)[1]
        assert on_demand["restore"] == f"oomguard restore {asked.stdout.strip()}"
