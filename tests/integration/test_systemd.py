"""Behaving as a service: sd_notify datagrams in order (a socket in the test stands in for
systemd), watchdog pings from the loop, the unit verifying cleanly, metrics and hooks after a
real checkpoint, and a TERM during a dump that leaves nothing stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    oomguard_argv,
    parse_events,
    proc_state,
    short_socket_path,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_notify_ready_status_watchdog_stopping_in_order(cgroups: CgroupFactory, store: Path,
                                                       tmp_path: Path) -> None:
    cg = cgroups.make("notify", 256 * MiB)
    path = short_socket_path().parent / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    env = {**os.environ, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"}
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(oomguard_argv(store, "--socket", str(path.parent / "c.sock"),
                                              "run", "--cgroup", str(cg.path)),
                                cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=out)
    try:
        messages = [receiver.recv(4096).decode()]
        assert messages[0].startswith("READY=1\nSTATUS=guarding 1 of 1 cgroup(s): "
                                      f"{cg.path}; 0 checkpoint(s) waiting"), messages
        # The log says it too, after every guard's guard.armed: what a log reader waits for.
        assert wait_until(lambda: "guard.ready" in log.read_text(), 10)
        names = [e.get("event") for e in parse_events(log.read_text())]
        assert names.index("guard.ready") > names.index("guard.armed")
        [ready] = [e for e in parse_events(log.read_text()) if e.get("event") == "guard.ready"]
        assert ready["guards"] == 1 and 0 < ready["seconds"] < 60
        assert str(ready["summary"]).startswith("guarding 1 of 1 cgroup(s)")
        start = time.monotonic()
        while time.monotonic() - start < 2.2:
            messages.append(receiver.recv(4096).decode())
        pings = [m for m in messages if m == "WATCHDOG=1"]
        assert len(pings) >= 3, messages  # every 0.5 s for a 1 s WatchdogSec
        assert any(m.startswith("STATUS=") for m in messages[1:])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        tail = []
        receiver.settimeout(1)
        try:
            while True:
                tail.append(receiver.recv(4096).decode())
        except TimeoutError:
            pass
        assert "STOPPING=1" in tail
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        receiver.close()
        shutil.rmtree(path.parent, ignore_errors=True)


def test_shipped_unit_installs_and_verifies(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    result = subprocess.run(oomguard_argv(tmp_path / "store", "install-units", "--unit-dir",
                                          str(tmp_path / "units"), "--config-dir",
                                          str(tmp_path / "etc"), "--user-unit-dir",
                                          str(tmp_path / "user")),
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    unit = tmp_path / "units" / "oomguard.service"
    text = unit.read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "OOMScoreAdjust=-1000" in text
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not any(line.startswith("MemoryMax=") for line in settings)
    assert (tmp_path / "etc" / "oomguard.toml").read_text() == \
        (REPO / "config" / "oomguard.toml").read_text()
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr
    agent_unit = tmp_path / "user" / "oomguard-notify-agent.service"
    assert "notify-agent" in agent_unit.read_text()
    runtime = tmp_path / "runtime"  # --user verification wants a user runtime directory
    runtime.mkdir(mode=0o700)
    verify = subprocess.run(["systemd-analyze", "--user", "verify", str(agent_unit)],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr


def test_metrics_and_hooks_after_a_real_checkpoint(cgroups: CgroupFactory, store: Path,
                                                   tmp_path: Path) -> None:
    cg = cgroups.make("metrics", 256 * MiB)
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    hook_out = tmp_path / "hook.env"
    port = _free_port()
    config = tmp_path / "metrics.toml"
    config.write_text(f'[daemon]\nmetrics_textfile_dir = "{textdir}"\nmetrics_port = {port}\n'
                      f'rescan_interval = "500ms"\n\n[hooks]\non_checkpoint = "env > {hook_out}"\n\n'
                      f'[[guard]]\ncgroups = ["{cg.path}"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                           count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        hog.wait(timeout=10)
        assert wait_until(lambda: hook_out.exists() and "OOMGUARD_ID" in hook_out.read_text(), 10)
        env = dict(line.split("=", 1) for line in hook_out.read_text().splitlines() if "=" in line)
        assert env["OOMGUARD_EVENT"] == "on_checkpoint"
        assert env["OOMGUARD_ID"] == done["id"] and env["OOMGUARD_PID"] == str(hog.pid)
        assert env["OOMGUARD_IMAGE_BYTES"] == str(done["image_bytes"])

        def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return _samples(reply.read().decode())

        assert wait_until(lambda: scraped().get(("oomguard_store_checkpoints", ())) == 1, 10)
        values = scraped()
        assert values[("oomguard_checkpoints_total", (("outcome", "done"),))] == 1
        assert values[("oomguard_freed_bytes_total", ())] == done["rss"]
        assert values[("oomguard_checkpoint_seconds_count", ())] == 1
        assert values[("oomguard_detection_latency_seconds_count", ())] == 1
        assert values[("oomguard_store_bytes", ())] == Store(store).list()[0].image_bytes
        assert values[("oomguard_cgroup_limit_bytes", (("cgroup", str(cg.path)),))] == 256 * MiB
        assert values[("oomguard_guards", ())] == 1
        prom = textdir / "oomguard.prom"
        assert wait_until(lambda: prom.exists() and 'outcome="done"} 1.0' in prom.read_text(), 10)


def test_term_during_a_dump_leaves_nothing_stopped(cgroups: CgroupFactory, store: Path,
                                                   tmp_path: Path) -> None:
    cg = cgroups.make("term", 900 * MiB)
    log = tmp_path / "hog.log"
    proc = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    try:
        proc.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(log, target=1000, rate=1000, count=300, chunk=8))
        proc.wait_event("victim.frozen", timeout=60)
        proc.handle.send_signal(signal.SIGTERM)  # the dump in flight must finish first
        assert proc.handle.wait(timeout=120) == 0
        assert proc.events("checkpoint.done"), proc.log.read_text()[-2000:]
        assert proc.events("guard.stopped")
        assert hog.wait(timeout=10) == -signal.SIGKILL
        assert not Store(store).partials()
        assert [m.pid for m in Store(store).list()] == [hog.pid]
        assert all(proc_state(pid) not in ("T", "t") for pid in cg.procs())
    finally:
        proc.stop()
        for pid in cg.procs():
            kill_pid(pid)


def test_systemd_oomd_prekill_hook_checkpoints_the_cgroup_first(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The test plays systemd-oomd: it calls io.systemd.oom.Prekill.Notify on the socket the
    daemon registered, and the cgroup's process is on disk before the reply comes."""
    cg = cgroups.make("prekill", None)
    hook_dir = short_socket_path().parent / "oomd.prekill.hook"
    config = tmp_path / "prekill.toml"
    config.write_text(f'[daemon]\noomd_prekill_dir = "{hook_dir}"\n')
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=64, rate=300, count=100_000))
    try:
        with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
            registered = guard.wait_event("oomd.prekill_registered")[0]
            sock_path = Path(registered["socket"])
            assert sock_path.parent == hook_dir
            assert wait_until(lambda: log.exists() and log.read_text().count("\n") > 5, 20)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as oomd:
                oomd.settimeout(60)
                oomd.connect(str(sock_path))
                oomd.sendall(json.dumps({"method": "io.systemd.oom.Prekill.Notify",
                                         "parameters": {"cgroup": cg.rel_path}}).encode() + b"\0")
                answer = b""
                while not answer.endswith(b"\0"):
                    answer += oomd.recv(65536)
            result = json.loads(answer[:-1])["parameters"]
            assert len(result["checkpoints"]) == 1 and result["failed"] == []
            assert hog.wait(timeout=10) == -signal.SIGKILL
            assert Store(store).get(result["checkpoints"][0]).pid == hog.pid
    finally:
        kill_pid(hog.pid)
        shutil.rmtree(hook_dir.parent, ignore_errors=True)
