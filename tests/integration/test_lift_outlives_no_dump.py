"""A limit lifted for a dump never outlives it: put back once the dump has failed, before the
next action; where it cannot be (the tree grew into the lifted room), the rule's chain acts on
the cgroup at once, down to its kill step if it must, once (no freeze and thaw of the same
tree over and over). And a crashed daemon's ledger never overrides a limit an administrator
set meanwhile.

The attackers: jobs whose growth cannot be dumped (one holds a Unix connection to a server
outside its tree, which CRIU refuses; one is traced by a process of its user's), in cgroups
with a limit, guarded by a real daemon."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.lifts import LIFTS_LEDGER
from oomguard.cgroup.base import MemoryCgroup
from oomguard.model.errors import CgroupGone
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    short_socket_path,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

# The hog, holding a connection to a Unix server outside its tree: CRIU cannot dump it.
LINKED_GROWER = r"""
import mmap, socket, sys, time
link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
link.connect(sys.argv[1])
log, first, most = open(sys.argv[2], "a", buffering=1), int(sys.argv[3]), int(sys.argv[4])
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
held = [mmap.mmap(-1, first << 20, flags=flags)]  # in one system call: no SIGSTOP inside
log.write(f"{first}\n")
while True:  # then on, 4 MiB at a time page by page, as far as it is let
    if (len(held) - 1) * 4 + first < most:
        more = mmap.mmap(-1, 4 << 20)
        more[::4096] = b"x" * 1024
        held.append(more)
    log.write(f"{(len(held) - 1) * 4 + first}\n")
    time.sleep(0.02)
"""


def _serve(server: socket.socket, accepted: list[socket.socket]) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        accepted.append(conn)


def _watch_limit(cgroup: MemoryCgroup, stop: threading.Event,
                 seen: list[tuple[float, int | None]]) -> None:
    """The limit file every 10 ms, with when (time.time, as the daemon's event timestamps)."""
    while not stop.is_set():
        with contextlib.suppress(OSError, CgroupGone):
            seen.append((time.time(), cgroup.limit()))
        time.sleep(0.01)


def _when(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def test_a_job_whose_growth_cannot_be_dumped_gets_its_limit_back_and_one_next_action(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A job holding a Unix connection to a server outside it (CRIU refuses it), taking 300 MiB
    in one system call in a 256 MiB cgroup, then growing: the dump fails with usage above the
    own limit, so the chain's next action runs at once (the rule has none: the kill the limit
    needs), once, and the limit is back within the dump's time."""
    cg = cgroups.make("linked", 256 * MiB)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = short_socket_path().with_name("peer.sock")
    server.bind(str(peer))
    server.listen(2)
    accepted: list[socket.socket] = []
    threading.Thread(target=_serve, args=(server, accepted), daemon=True).start()
    log = tmp_path / "grower.log"
    grower = None
    stop = threading.Event()
    limits: list[tuple[float, int | None]] = []
    watcher = threading.Thread(target=_watch_limit, args=(cg, stop, limits), daemon=True)
    try:
        watcher.start()
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
            guard.wait_event("guard.ready")
            grower = start_in_cgroup(cg, [sys.executable, "-c", LINKED_GROWER, str(peer),
                                          str(log), "300", "400"])
            killed = guard.wait_event("victim.killed", timeout=60)[0]
            restored = guard.wait_event("limit.restored", timeout=30)[0]
            assert grower.wait(timeout=30) is not None
            time.sleep(3)  # nothing more comes: no second freeze, no second lift
            events = guard.events()
        stop.set()
        watcher.join()
        assert accepted, "the grower never connected to the server outside its tree"
        frozen = [e for e in events if e.get("event") == "victim.frozen"]
        failed = [e for e in events if e.get("event") == "checkpoint.failed"]
        assert len(frozen) == 1 and len(failed) == 1, [e.get("event") for e in events]
        assert "Can't dump half of stream unix connection" in failed[0]["error"]
        assert "is above the limit" in failed[0]["limit_busy"], failed[0]
        assert "could not be put back" in failed[0]["error"]
        assert failed[0]["then"].startswith("kill")
        assert killed["pid"] == grower.pid and "limit_busy" in killed
        assert "room lifted for its dump" in killed["explanation"]
        assert len([e for e in events if e.get("event") == "victim.killed"]) == 1
        # Lifted for the dump only: from the freeze to the kill's end, never after.
        lifted = [at for at, limit in limits if limit != 256 * MiB]
        assert lifted, "no headroom was ever lifted (nothing was tested)"
        assert _when(frozen[0]) - 0.1 <= min(lifted) and max(lifted) <= _when(restored) + 0.1
        assert max(lifted) - min(lifted) < 10, "the lifted limit outlived the dump"
        assert cg.limit() == 256 * MiB
        assert all(limit == 256 * MiB for at, limit in limits if at > _when(restored) + 0.1)
        assert json.loads((store / LIFTS_LEDGER).read_text()) == {}
        print(f"\nlifted {max(lifted) - min(lifted):.2f} s (dump failed after "
              f"{_when(failed[0]) - _when(frozen[0]):.2f} s), top "
              f"{max(limit or 0 for _, limit in limits) >> 20} MiB")
    finally:
        stop.set()
        if grower is not None:
            kill_pid(grower.pid)
        server.close()
        for conn in accepted:
            conn.close()


def test_a_crashed_daemons_lift_never_overrides_the_limit_an_administrator_set_meanwhile(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The daemon is SIGKILLed during a dump with the limit lifted; an administrator sets 512
    MiB; the next daemon finds the ledger's entry and leaves the 512 MiB as it is (before, it
    put back the 200 MiB the ledger had recorded)."""
    cg = cgroups.make("adminset", 200 * MiB)
    hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=150, rate=1000,
                                       count=100_000))
    sock = short_socket_path()
    try:
        assert wait_until(lambda: last_count(tmp_path / "hog.log") > 40, 20)
        first = DaemonProcess(store, tmp_path / "first.log", socket=sock)
        try:
            first.wait_event("guard.started")
            assert wait_until(sock.exists, 10)
            client = subprocess.Popen(
                [sys.executable, "-c", "import sys; from oomguard.control.client import "
                 "ControlClient as C; C(__import__('pathlib').Path(sys.argv[1]))"
                 ".call('Checkpoint', pid=int(sys.argv[2]))", str(sock), str(hog.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            assert wait_until(lambda: cg.limit() != 200 * MiB, 30), "no headroom was lifted"
            lifted = cg.limit()
            entry = json.loads((store / LIFTS_LEDGER).read_text())[str(cg.path)]
            assert entry["state"]["max"] == 200 * MiB and lifted in entry["lifted"], entry
            first.handle.send_signal(signal.SIGKILL)
            first.handle.wait()
            client.wait(timeout=30)
        finally:
            first.stop()
        cg.set_limit(512 * MiB)  # the administrator, while no daemon runs
        with daemon(store, tmp_path / "second.log", "--cgroup", str(cg.path),
                    socket=sock) as second:
            left = second.wait_event("limit.left_as_set", timeout=60)[0]
            assert left["cgroup"] == str(cg.path)
            assert f"the limit is {512 * MiB}" in left["explanation"], left
            armed = second.wait_event("guard.armed", timeout=30)
            assert all(e.get("limit") == 512 * MiB for e in armed), armed
            time.sleep(2)  # a rescan or two: nothing puts the 200 MiB back
            assert cg.limit() == 512 * MiB
            assert not second.events("limit.restored")
        assert cg.limit() == 512 * MiB
        assert json.loads((store / LIFTS_LEDGER).read_text()) == {}
    finally:
        kill_pid(hog.pid)
