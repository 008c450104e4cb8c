"""The headroom lifted for a dump cannot be turned into a bigger limit: an unprivileged user's
on-demand checkpoints lift nothing, a daemon killed mid-dump has its lift put back by the next
start, and a limit that cannot be put back because something grew into the room is brought
back by the guard acting on the grower."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from oomguard.control.client import ControlClient
from oomguard.store.names import LIFTS_LEDGER
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    checkpoint_through_socket,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration
MALLORY = 40031


def test_unprivileged_on_demand_checkpoints_lift_no_limit(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="og-lift-", dir="/tmp"))
    workdir.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    cg = cgroups.make("userlift", 200 * MiB)
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    mallory = unprivileged_user("oomguard-t-mallory", MALLORY)
    as_mallory = ["setpriv", f"--reuid={mallory}", f"--regid={mallory}", "--clear-groups", "--"]
    idle = start_in_cgroup(cg, [*as_mallory, *hog_argv(workdir / "idle.log", target=16,
                                                       rate=200, count=100_000)], cwd=workdir)
    # The other process takes nearly all the room there is (with the interpreters: ~185 of 200).
    taker = start_in_cgroup(cg, [*as_mallory, *hog_argv(workdir / "taker.log", target=150,
                                                        rate=400, count=100_000)], cwd=workdir)
    try:
        assert wait_until(lambda: last_count(workdir / "taker.log") > 50, 20)
        with daemon(store, tmp_path / "daemon.log", socket=sock) as guard:
            guard.wait_event("guard.started")
            assert wait_until(sock.exists, 10)
            for _ in range(5):
                asked = subprocess.run(
                    [*as_mallory, sys.executable, "-m", "oomguard", "--socket", str(sock),
                     "checkpoint", str(idle.pid)], capture_output=True, text=True, cwd="/",
                    timeout=120, stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"]})
                assert cg.limit() == 200 * MiB, asked.stderr
                if asked.returncode == 0:  # where CRIU can dump another user's process
                    break
                assert idle.poll() is None, "a failed checkpoint must leave it running"
        assert cg.limit() == 200 * MiB
        assert cg.snapshot().oom_kills == 0
        ledger = store / LIFTS_LEDGER
        assert not ledger.exists() or json.loads(ledger.read_text()) == {}
    finally:
        kill_pid(idle.pid)
        kill_pid(taker.pid)


def test_daemon_killed_mid_dump_has_its_lift_put_back_at_next_start(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("crashlift", 320 * MiB)
    hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=280, rate=1000,
                                       count=100_000))
    sock = short_socket_path()
    try:
        assert wait_until(lambda: last_count(tmp_path / "hog.log") > 80, 20)
        first = DaemonProcess(store, tmp_path / "first.log", socket=sock)
        try:
            first.wait_event("guard.started")
            assert wait_until(sock.exists, 10)
            client = checkpoint_through_socket(sock, hog.pid)
            assert wait_until(lambda: cg.limit() != 320 * MiB, 30), "no headroom was lifted"
            assert cg.limit() <= 320 * MiB + 64 * MiB
            assert str(cg.path) in json.loads((store / LIFTS_LEDGER).read_text())
            first.handle.send_signal(signal.SIGKILL)
            first.handle.wait()
            client.wait(timeout=30)
        finally:
            first.stop()
        with daemon(store, tmp_path / "second.log", socket=sock) as second:
            restored = second.wait_event("limit.restored", timeout=60)[0]
            assert restored["cgroup"] == str(cg.path)
            assert cg.limit() == 320 * MiB
            assert json.loads((store / LIFTS_LEDGER).read_text()) == {}
    finally:
        kill_pid(hog.pid)


RECORD_DEAD_LIFT = r"""
import sys
from pathlib import Path
from oomguard.cgroup.mounts import open_cgroup, read_layout
from oomguard.act.lifts import LimitLifts
cgroup = open_cgroup(sys.argv[2], read_layout())
LimitLifts(Path(sys.argv[1])).lift(cgroup, int(sys.argv[3]), cap=int(sys.argv[4]))
"""  # lifts, then exits without putting back: what a daemon killed mid-dump leaves


def test_a_grower_in_the_lifted_room_is_acted_on_until_the_limit_is_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("grower", 256 * MiB)
    store.mkdir(mode=0o700)
    subprocess.run([sys.executable, "-c", RECORD_DEAD_LIFT, str(store / LIFTS_LEDGER),
                    str(cg.path), str(320 * MiB), str(64 * MiB)], check=True, timeout=30)
    assert cg.limit() == 320 * MiB
    # Something takes the lifted room: 290 MiB, more than the cgroup's own 256 MiB.
    grower = start_in_cgroup(cg, hog_argv(tmp_path / "grower.log", target=290, rate=1000,
                                          count=100_000))
    try:
        assert wait_until(lambda: last_count(tmp_path / "grower.log") > 80, 30)
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
            failed = guard.wait_event("limit.restore_failed", timeout=30)[0]
            assert failed["cgroup"] == str(cg.path)
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert done["pid"] == grower.pid
            guard.wait_event("limit.restored", timeout=30)
            assert cg.limit() == 256 * MiB
            armed = guard.events("guard.armed")
            assert all(e.get("limit") in (None, 256 * MiB) for e in armed), armed
            with ControlClient(guard.socket) as root:
                assert root.call("Status")
        assert cg.snapshot().oom_kills == 0
        assert json.loads((store / LIFTS_LEDGER).read_text()) == {}
    finally:
        kill_pid(grower.pid)


# A process that lowers the limit through the ledger and dies holding it (SIGKILL).
DIE_HOLDING_LOWER = r"""
import os, signal, sys
from pathlib import Path
from oomguard.act.lifts import LimitLifts
from oomguard.cgroup.v1 import V1MemoryCgroup
cg = V1MemoryCgroup(sys.argv[2], sys.argv[3])
LimitLifts(Path(sys.argv[1])).lower(cg, int(sys.argv[4]))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_limit_lowered_for_a_reclaim_is_recorded_and_always_comes_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """cgroup v1's reclaim for the pageout step (LimitLifts.lower): the limit set below usage
    for a moment makes the kernel reclaim (here clean page cache) before the write returns;
    it is recorded before it is written, the release puts the own limit back, and a holder
    that dies with it leaves it to the next daemon's start, which puts it back."""
    from oomguard.act.lifts import LimitLifts
    from oomguard.cgroup.v1 import V1MemoryCgroup

    cg = cgroups.make("lower", 400 * MiB)
    if not isinstance(cg, V1MemoryCgroup):
        pytest.skip("cgroup v1's way (v2 has memory.reclaim)")
    writer = start_in_cgroup(cg, ["dd", "if=/dev/zero", f"of={tmp_path / 'cache.dat'}",
                                  "bs=1M", "count=150", "conv=fsync", "status=none"])
    assert writer.wait(timeout=60) == 0
    before = cg.usage()
    assert before >= 140 * MiB
    ledger = store / LIFTS_LEDGER
    store.mkdir(parents=True, exist_ok=True)
    lifts = LimitLifts(ledger)
    release = lifts.lower(cg, before - 100 * MiB)
    assert cg.limit() == (before - 100 * MiB) // 4096 * 4096
    assert cg.usage() <= before - 100 * MiB  # reclaimed before the write returned
    assert lifts.lifted(cg.path) and lifts.own_limit(cg.path) == (True, 400 * MiB)
    assert release() is None
    assert cg.limit() == 400 * MiB and json.loads(ledger.read_text()) == {}

    # A holder that dies with the limit lowered: the next daemon puts it back at its start.
    subprocess.run([sys.executable, "-c", DIE_HOLDING_LOWER, str(ledger), str(cg.path),
                    str(cg.mount), str(64 * MiB)], check=False, timeout=30)
    assert cg.limit() == 64 * MiB
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
        guard.wait_event("guard.ready")
        assert wait_until(lambda: cg.limit() == 400 * MiB, 10), cg.limit()
    assert json.loads(ledger.read_text()) == {}
