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
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.model.errors import CgroupGone
from oomguard.store.names import LIFTS_LEDGER
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    as_user,
    checkpoint_through_socket,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    outside_server,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    users_workdir,
    wait_until,
)
from tests.integration.test_limit_lifts import RECORD_DEAD_LIFT

pytestmark = pytest.mark.integration
MALLORY = 40063

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
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    log = tmp_path / "grower.log"
    grower = None
    stop = threading.Event()
    limits: list[tuple[float, int | None]] = []
    watcher = threading.Thread(target=_watch_limit, args=(cg, stop, limits), daemon=True)
    try:
        watcher.start()
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                    "--actions", "checkpoint") as guard:  # no next step of its own
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
        # Lifted for the dump only: from its crossing (the room is lifted just before the
        # stop: test_early_room.py) to the kill's end, never after.
        crossed = [e for e in events if e.get("event") == "threshold.crossed"]
        lifted = [at for at, limit in limits if limit != 256 * MiB]
        assert lifted, "no headroom was ever lifted (nothing was tested)"
        assert _when(crossed[0]) - 0.1 <= min(lifted) and max(lifted) <= _when(restored) + 0.1
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


# A user's debugger that keeps its program running: the program (its child) is traced, and
# every stop is passed over with its signal dropped (SIGSTOP included: a stop oomguard sends
# never holds it), other signals delivered. The program waits for "go" on stdin (the test
# moves it into the cgroup first), then grows 4 MiB a system call (MAP_POPULATE) to MOST MiB.
TRACED_GROWER = r"""
import ctypes, mmap, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE, PTRACE_CONT, WALL = 0x4206, 7, 0x40000000
log, most = sys.argv[1], int(sys.argv[2])
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
kid = os.fork()
if kid == 0:
    sys.stdin.readline()
    held = []
    with open(log, "a", buffering=1) as out:
        while True:
            if len(held) * 4 < most:  # 4 MiB a system call: fast
                try:
                    held.append(mmap.mmap(-1, 4 << 20, flags=flags))
                except OSError:  # ENOMEM at the limit: tries again
                    pass
            try:
                out.write(f"{len(held) * 4}\n")
            except OSError:  # ENOMEM: a write's page cache at the limit
                pass
            time.sleep(0.005)
if libc.ptrace(PTRACE_SEIZE, kid, None, None) != 0:
    sys.exit(f"ptrace: errno {ctypes.get_errno()}")
print(kid, flush=True)
stops = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
while True:
    try:
        _, status = os.waitpid(kid, WALL)
    except ChildProcessError:
        break
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break
    if os.WIFSTOPPED(status):
        sig = os.WSTOPSIG(status)
        libc.ptrace(PTRACE_CONT, kid, None, 0 if sig in stops else sig)
"""


def test_a_traced_grower_takes_the_room_lifted_for_anothers_dump_and_the_limit_comes_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """A real user's program, traced by their debugger (never a checkpoint's victim: refused),
    grows fast in a 200 MiB cgroup beside a job that holds a Unix connection to a server
    outside it. That job is the victim; while it is dumped, SIGSTOP does not hold the traced
    program, which takes the room lifted for the dump; the dump fails (the connection) with
    usage above 200 MiB. Before, the limit stayed lifted and nothing more was done (the
    victim, refused for good, thawed; the grower never a victim). Now the chain acts at once:
    the kill the limit needs (the rule has no kill step), once, then the grower's if what it
    took alone still keeps the limit from coming back, and the limit is back."""
    mallory = unprivileged_user("oomguard-t-mallory3", MALLORY)
    workdir = users_workdir(mallory, "og-traced-")
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    as_mallory = as_user(mallory)
    cg = cgroups.make("traced", 200 * MiB)
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    linked = start_in_cgroup(cg, [sys.executable, "-c", LINKED_GROWER, str(peer),
                                  str(tmp_path / "linked.log"), "60", "60"])
    log = workdir / "grower.log"
    debugger = subprocess.Popen([*as_mallory, sys.executable, "-c", TRACED_GROWER, str(log),
                                 "400"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd="/", start_new_session=True)
    assert debugger.stdin is not None and debugger.stdout is not None
    grower = 0
    stop = threading.Event()
    limits: list[tuple[float, int | None]] = []
    watcher = threading.Thread(target=_watch_limit, args=(cg, stop, limits), daemon=True)
    try:
        grower = int(debugger.stdout.readline())
        cg.add_proc(grower)
        assert wait_until(lambda: accepted and (tmp_path / "linked.log").exists(), 20)
        watcher.start()
        # (At 95%: the grower needs little of the room lifted for the dump to end above the
        # limit, however slowly a loaded host lets it grow.)
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                    "--threshold", "0.95", "--actions", "checkpoint") as guard:
            guard.wait_event("guard.ready")
            debugger.stdin.write("go\n")
            debugger.stdin.flush()
            killed = guard.wait_event("victim.killed", timeout=60)[0]
            restored = guard.wait_event("limit.restored", timeout=30)[-1]
            time.sleep(3)  # nothing more comes: no further freeze, no further lift
            events = guard.events()
        stop.set()
        watcher.join()
        names = [e.get("event") for e in events]
        refused = [e for e in events if e.get("event") == "checkpoint.refused"
                   and e.get("pid") == grower]
        assert refused and all("traced by" in e["reason"] for e in refused), names
        failed = [e for e in events if e.get("event") == "checkpoint.failed"]
        assert len(failed) == 1 and failed[0]["pid"] == linked.pid, names
        assert "is above the limit" in failed[0]["limit_busy"], failed[0]
        assert killed["pid"] == linked.pid and "limit_busy" in killed, killed
        # Then the grower too where what it took alone keeps the limit from coming back (the
        # settling's look: refused, killed). Each once; one freeze: never a loop.
        kills = [e for e in events if e.get("event") == "victim.killed"]
        assert all("limit_busy" in e for e in kills), kills
        assert [e["pid"] for e in kills] in ([linked.pid], [linked.pid, grower]), kills
        assert names.count("victim.frozen") == 1, names
        lifted = [at for at, limit in limits if limit != 200 * MiB]
        assert lifted, "no headroom was ever lifted (nothing was tested)"
        assert max(lifted) <= _when(restored) + 0.1
        assert max(lifted) - min(lifted) < 10, "the lifted limit outlived the dump"
        assert cg.limit() == 200 * MiB
        assert all(limit == 200 * MiB for at, limit in limits if at > _when(restored) + 0.1)
        print(f"\nlifted {max(lifted) - min(lifted):.2f} s, top "
              f"{max(limit or 0 for _, limit in limits) >> 20} MiB; the traced grower took "
              f"{last_count(log)} MiB")
    finally:
        stop.set()
        if grower:
            kill_pid(grower)
        kill_pid(linked.pid)
        kill_pid(debugger.pid)
        debugger.wait(10)
        server.close()
        for conn in accepted:
            conn.close()


def test_a_dead_runs_lift_taken_by_a_traced_grower_is_acted_on_down_to_the_kill(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """A lift a dead run left (320 MiB over the own 256), taken by a real user's traced
    program (290 MiB): the next daemon cannot put the limit back, and the grower can never be
    checkpointed. Before, it said so (victim.none) and left the limit lifted for good; now
    the chain runs on it at once, the checkpoint refused, the kill the limit needs, once."""
    mallory = unprivileged_user("oomguard-t-mallory3", MALLORY)
    workdir = users_workdir(mallory, "og-traced-")
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    as_mallory = as_user(mallory)
    cg = cgroups.make("deadtraced", 256 * MiB)
    store.mkdir(mode=0o700)
    subprocess.run([sys.executable, "-c", RECORD_DEAD_LIFT, str(store / LIFTS_LEDGER),
                    str(cg.path), str(320 * MiB), str(64 * MiB)], check=True, timeout=30)
    assert cg.limit() == 320 * MiB
    log = workdir / "grower.log"
    debugger = subprocess.Popen([*as_mallory, sys.executable, "-c", TRACED_GROWER, str(log),
                                 "290"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd="/", start_new_session=True)
    assert debugger.stdin is not None and debugger.stdout is not None
    grower = 0
    try:
        grower = int(debugger.stdout.readline())
        cg.add_proc(grower)
        debugger.stdin.write("go\n")
        debugger.stdin.flush()
        assert wait_until(lambda: last_count(log) >= 290, 30)
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
            busy = guard.wait_event("limit.restore_failed", timeout=30)[0]
            killed = guard.wait_event("victim.killed", timeout=60)[0]
            guard.wait_event("limit.restored", timeout=30)
            assert cg.limit() == 256 * MiB
            time.sleep(3)  # nothing more comes
            events = guard.events()
        names = [e.get("event") for e in events]
        assert busy["cgroup"] == str(cg.path)
        refused = [e for e in events if e.get("event") == "checkpoint.refused"]
        assert len(refused) == 1 and "traced by" in refused[0]["reason"], names
        assert refused[0]["then"].startswith("kill"), refused[0]
        assert killed["pid"] == grower and "limit_busy" in killed, killed
        assert names.count("victim.killed") == 1 and "victim.frozen" not in names, names
        assert cg.limit() == 256 * MiB
        assert json.loads((store / LIFTS_LEDGER).read_text()) == {}
    finally:
        if grower:
            kill_pid(grower)
        kill_pid(debugger.pid)
        debugger.wait(10)


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
            client = checkpoint_through_socket(sock, hog.pid)
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
