"""`oomguard doctor` on the config the service uses: each guarded cgroup (present with a
limit, present without one, absent), whether the daemon answers on the configured socket, the
configured store; and, on a machine without an NVIDIA driver, one quiet gpu line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.cli.doctor import nvidia_driver_loaded
from oomguard.model.units import format_size
from oomguard.sense.procevents import Subscriber
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    run_cli,
    short_socket_path,
)

pytestmark = pytest.mark.integration


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "OOMGUARD_CONFIG"}


def _lines(output: str, name: str) -> list[str]:
    return [line for line in output.splitlines() if line[6:].startswith(f"{name}:")]


def test_doctor_checks_the_configured_guards_store_and_daemon(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    limited = cgroups.make("doc-limited", 128 * MiB)
    unlimited = cgroups.make("doc-unlimited", None)
    missing = limited.path.parent / f"oomguard-test-{os.getpid()}-doc-missing"
    sock = short_socket_path()
    config = tmp_path / "oomguard.toml"
    config.write_text(
        f'[daemon]\nstore = "{store}"\nsocket = "{sock}"\n\n'
        f'[[guard]]\ncgroups = ["{limited.path}", "{unlimited.path}"]\nthreshold = "75%"\n\n'
        f'[[guard]]\ncgroups = ["{missing}"]\n')
    before = run_cli("--config", str(config), "doctor", env=_environ())
    assert before.returncode == 0, before.stdout + before.stderr
    out = before.stdout
    assert _lines(out, "config") == [f"PASS  config: {config} (from --config), 2 guard rules"]
    first, second = _lines(out, "guard[0]")
    assert first == (f"PASS  guard[0]: {limited.path}: limit {format_size(128 * MiB)}, "
                     f"acts at 75% ({format_size(96 * MiB)})")
    assert second.startswith(f"WARN  guard[0]: {unlimited.path}: no memory limit")
    (absent,) = _lines(out, "guard[1]")
    assert absent.startswith(f"WARN  guard[1]: {missing}: absent")
    (daemon_line,) = _lines(out, "daemon")
    assert daemon_line.startswith(f"WARN  daemon: no daemon answers on {sock}")
    (store_line,) = _lines(out, "store")
    assert str(store) in store_line

    daemon = DaemonProcess(store, tmp_path / "daemon.log", socket=sock, config=config,
                           env=_environ())
    try:
        daemon.wait_event("guard.started")
        after = run_cli("doctor", env={**_environ(), "OOMGUARD_CONFIG": str(config)})
        assert after.returncode == 0, after.stdout + after.stderr
        (daemon_line,) = _lines(after.stdout, "daemon")
        assert daemon_line.startswith(f"PASS  daemon: answers on {sock} "
                                      f"(pid {daemon.handle.pid}, 3 guards)"), daemon_line
        assert _lines(after.stdout, "config")[0].endswith("(from $OOMGUARD_CONFIG), 2 guard rules")
    finally:
        assert daemon.stop() == 0


def test_doctor_without_an_nvidia_driver_prints_one_gpu_line(tmp_path: Path) -> None:
    if nvidia_driver_loaded():
        pytest.skip("an NVIDIA driver is loaded here")
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nsocket = "{tmp_path / "none.sock"}"\n')
    result = run_cli("--config", str(config), "doctor", env=_environ())
    assert result.returncode == 0, result.stdout
    assert _lines(result.stdout, "gpu") == ["PASS  gpu: none (no NVIDIA driver loaded)"]
    lowered = result.stdout.lower()
    for noise in ("nvml", "cuda", "gpu actions"):
        assert noise not in lowered, result.stdout
    (psi,) = _lines(result.stdout, "psi")
    assert "'some" not in psi  # in words, not the trigger string


def test_doctor_says_whether_process_events_reach_it(tmp_path: Path) -> None:
    """Here (root, the initial namespaces) the connector; in a network namespace of its own,
    as in a container, the kernel refuses and the freeze re-lists /proc."""
    why = Subscriber().probe()
    if why is not None:
        pytest.skip(f"no process events on this machine: {why}")
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nstore = "{tmp_path / "store"}"\n'
                      f'socket = "{tmp_path / "none.sock"}"\n')
    here = run_cli("--config", str(config), "doctor", env=_environ())
    assert _lines(here.stdout, "process events") == [
        "PASS  process events: kernel connector (fork/exit seen at once)"], here.stdout
    contained = run_cli("--config", str(config), "doctor", env=_environ(),
                        as_user=["unshare", "--net"])
    assert _lines(contained.stdout, "process events") == [
        "WARN  process events: unavailable (ECONNREFUSED: not in the initial network "
        "namespace (a container?)): freeze re-lists /proc"], contained.stdout


def test_doctor_finds_the_criu_setup_built_keeping_its_kernel_probe(tmp_path: Path) -> None:
    """scripts/setup's CRIU caches its kernel probe on a tmpfs: /run where that is one, else
    /dev/shm (this VM's /run is not), and doctor says where."""
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nsocket = "{tmp_path / "none.sock"}"\n')
    result = run_cli("--config", str(config), "doctor", env=_environ())
    (line,) = _lines(result.stdout, "criu probe cache")
    assert line.startswith("PASS  criu probe cache: ") and "criu.kdat on tmpfs" in line, line
