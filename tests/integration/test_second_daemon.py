"""A second `oomguard run` beside a live one (issue 26, item 1), as the attacker ran it: the
same store and socket, or another store guarding the same cgroup (spelled another way). It
refused within a second, exit status non-zero, naming the first's PID, and changed nothing:
the cgroup's settings (v1 oom_kill_disable, the limits), the socket, the store's files, the
standby. The first daemon still checkpoints a job afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.daemon.locks import LOCK_DIR
from oomguard.store.names import STANDBY_RECORD, STORE_LOCK
from tests.helpers import (
    EMULATION_FACTOR,
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    oomguard_argv,
    short_socket_path,
    start_in_cgroup,
)

pytestmark = pytest.mark.integration

SETTINGS = ("memory.oom_control", "memory.limit_in_bytes", "memory.soft_limit_in_bytes",
            "memory.high", "memory.max", "memory.low", "memory.oom.group")


def _settings(cg: MemoryCgroup) -> dict[str, str]:
    found = {}
    for name in SETTINGS:
        path = cg.path / name
        if path.exists():
            found[name] = path.read_text()
    return found


def _files(store: Path) -> dict[str, tuple[int, int, int]]:
    """Every file of the store: (inode, size, mtime)."""
    seen = {}
    for path in store.rglob("*"):
        st = path.lstat()
        seen[str(path.relative_to(store))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return seen


def _second(store: Path, socket: Path, cgroup: str) -> tuple[subprocess.CompletedProcess[str],
                                                             float]:
    began = time.monotonic()
    result = subprocess.run(oomguard_argv(store, "--socket", str(socket), "run", "--cgroup",
                                          cgroup), capture_output=True, text=True, timeout=60,
                            cwd=REPO, stdin=subprocess.DEVNULL)
    return result, time.monotonic() - began


def _standby_alive(store: Path) -> int:
    record = json.loads((store / STANDBY_RECORD).read_text())
    os.kill(int(record["pid"]), 0)  # raises if it was killed
    return int(record["pid"])


def test_a_second_daemon_refuses_and_changes_nothing(cgroups: CgroupFactory, store: Path,
                                                     tmp_path: Path) -> None:
    cg = cgroups.make("twice", 256 * MiB)
    other_store = tmp_path / "other-store"
    with daemon(store, tmp_path / "first.log", "--cgroup", str(cg.path)) as first:
        first.wait_event("guard.ready", timeout=60)
        if cg.path.joinpath("memory.oom_control").exists():  # v1: what the attacker undid
            assert "oom_kill_disable 1" in cg.path.joinpath("memory.oom_control").read_text()
        settings, files = _settings(cg), _files(store)
        socket_inode = first.socket.stat().st_ino
        standby = _standby_alive(store)
        relative = "/" + str(cg.path.relative_to(cg.mount))  # the same cgroup, spelled short

        elsewhere = cgroups.make("elsewhere", 256 * MiB)
        elsewhere_settings = _settings(elsewhere)
        attempts = [  # (what, store, socket, cgroup, the lock named in the refusal)
            ("same store and socket", store, first.socket, str(cg.path), str(cg.path)),
            ("another store, same cgroup", other_store, short_socket_path(), relative,
             str(cg.path)),
            ("same store, another cgroup", store, short_socket_path(), str(elsewhere.path),
             f"store {store}")]
        for label, other, socket, path, named in attempts:
            result, seconds = _second(other, socket, path)
            if socket != first.socket:
                shutil.rmtree(socket.parent, ignore_errors=True)
            assert result.returncode != 0, (label, result.stdout, result.stderr)
            assert seconds < 1.0 * EMULATION_FACTOR, (label, seconds)
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "Traceback" not in result.stderr, (label, result.stderr)
            assert f"pid {first.handle.pid}" in lines[0], (label, lines)
            assert named in lines[0], (label, lines)
            # Nothing changed: the cgroup's settings, the socket, the store, the standby.
            assert _settings(cg) == settings, label
            assert _settings(elsewhere) == elsewhere_settings, label
            assert first.socket.stat().st_ino == socket_inode, label
            assert _files(store) == files, label
            assert _standby_alive(store) == standby, label
            assert first.handle.poll() is None, label
            print(f"{label}: refused in {seconds:.3f} s: {lines[0]}")
        assert not other_store.exists()

        # The first still guards: a job that outgrows the cgroup is checkpointed, not killed.
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=200,
                                           count=250))
        done = first.wait_event("checkpoint.done", timeout=90)[0]
        assert done["pid"] == hog.pid
        assert hog.wait(timeout=10) == -signal.SIGKILL
    assert cg.snapshot().oom_kills == 0


def test_the_locks_go_with_the_daemon(cgroups: CgroupFactory, store: Path,
                                      tmp_path: Path) -> None:
    """SIGKILLed, the first leaves no lock behind (the kernel lets an flock go): the next
    starts at once; stopped cleanly, a daemon removes its lock files."""
    cg = cgroups.make("after", 256 * MiB)
    first = DaemonProcess(store, tmp_path / "first.log", "--cgroup", str(cg.path))
    try:
        first.wait_event("guard.ready", timeout=60)
        first.handle.send_signal(signal.SIGKILL)
        first.handle.wait()
    finally:
        first.stop()
    with daemon(store, tmp_path / "second.log", "--cgroup", str(cg.path)) as second:
        second.wait_event("guard.ready", timeout=60)
        held = [p for p in LOCK_DIR.glob("cgroup-*.lock")
                if p.read_text().split()[0] == str(second.handle.pid)]
        assert len(held) == 1 and str(cg.path) in held[0].read_text()
        assert (store / STORE_LOCK).read_text().split()[0] == str(second.handle.pid)
    assert not held[0].exists() and not (store / STORE_LOCK).exists()


def test_a_reload_that_would_take_another_daemons_cgroup_is_rejected(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Two daemons, two stores, two cgroups; the second's config gains the first's cgroup and
    it is told to reload: rejected (config.rejected names the first's PID), its own rule
    stays, and the first's cgroup keeps its settings."""
    mine, theirs = cgroups.make("mine", 256 * MiB), cgroups.make("theirs", 256 * MiB)
    config = tmp_path / "second.toml"
    config.write_text(f'[[guard]]\ncgroups = ["{mine.path}"]\n')
    with daemon(store, tmp_path / "first.log", "--cgroup", str(theirs.path)) as first, \
            daemon(tmp_path / "second-store", tmp_path / "second.log", "--config",
                   str(config)) as second:
        first.wait_event("guard.ready", timeout=60)
        second.wait_event("guard.ready", timeout=60)
        settings = _settings(theirs)
        config.write_text(f'[[guard]]\ncgroups = ["{mine.path}", "{theirs.path}"]\n')
        second.handle.send_signal(signal.SIGHUP)
        rejected = second.wait_event("config.rejected", timeout=20)[0]
        assert any(f"pid {first.handle.pid}" in issue and str(theirs.path) in issue
                   for issue in rejected["issues"]), rejected
        assert not second.events("config.reloaded")
        assert _settings(theirs) == settings
        assert [e["cgroup"] for e in second.events("guard.armed")] == [str(mine.path)]
        # Without the other's cgroup the same reload goes through.
        config.write_text(f'[[guard]]\ncgroups = ["{mine.path}"]\nthreshold = "80%"\n')
        second.handle.send_signal(signal.SIGHUP)
        second.wait_event("config.reloaded", timeout=20)
        assert first.handle.poll() is None and second.handle.poll() is None
