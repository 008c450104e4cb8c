"""The control socket under attack by unprivileged users: a connection flood, a request trickled
one byte at a time, a frame of 64 KiB of NUL bytes, deeply nested JSON. The daemon stays
responsive, its threads stay bounded, its log stays small, and it still checkpoints a hog in
a guarded cgroup instead of letting the kernel kill it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.control.client import ControlClient
from oomguard.control.limits import MAX_CONNECTIONS, MAX_PER_UID, REQUEST_DEADLINE
from tests.helpers import (
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    short_socket_path,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
MALLORY, TRUDY = 40011, 40012

# Opens N connections to the socket, sends one byte on each (a request never finished), and
# reports how many were refused at once with TooManyConnections; then holds the rest open.
FLOODER = r"""
import json, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
held, refused = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    try:
        s.sendall(b"{")
    except BrokenPipeError:
        pass  # refused and closed at once: its reply is still there to read
    s.settimeout(0.3)
    try:
        data = s.recv(4096)
    except TimeoutError:
        held.append(s)
        continue
    if b"TooManyConnections" in data:
        refused += 1
    s.close()
print(json.dumps({"held": len(held), "refused": refused}), flush=True)
time.sleep(float(sys.argv[3]))
"""


def as_user_popen(uid: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                             "--", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/", stdin=subprocess.DEVNULL,
                            env={"PATH": os.environ["PATH"]})


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def control_lines(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if '"control.' in line)


def test_connection_flood_is_bounded_and_the_guard_still_acts(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("flood", 256 * MiB)
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path), socket=sock) as guard:
        guard.wait_event("guard.armed")
        assert wait_until(sock.exists, 10)
        before = threads_of(guard.handle.pid)
        floods = [as_user_popen(uid, [sys.executable, "-c", FLOODER, str(sock), "300", "60"])
                  for uid in (MALLORY, TRUDY)]
        try:
            for flood in floods:
                assert flood.stdout is not None
                counts = json.loads(flood.stdout.readline())
                assert counts["held"] == MAX_PER_UID, counts
                assert counts["refused"] == 300 - MAX_PER_UID, counts
            assert threads_of(guard.handle.pid) <= before + 2 * MAX_PER_UID + 2
            # Root still gets an answer while both users hold all they may.
            with ControlClient(sock) as root:
                assert "status" in root.call("Status")
            # And the guard still acts first: a hog is checkpointed, not OOM-killed.
            hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                               count=100_000))
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert done["pid"] == hog.pid
            hog.wait(timeout=10)
            assert cg.snapshot().oom_kills == 0
            # The held half-requests are cut at their deadline, not held for the idle timeout.
            # (their threads end although the flooders still hold their ends open).
            assert wait_until(lambda: threads_of(guard.handle.pid) <= before + 1,
                              REQUEST_DEADLINE + 10)
        finally:
            for flood in floods:
                flood.kill()
                flood.wait()
        # 600 refused connections, logged at a bounded rate per uid.
        assert control_lines(tmp_path / "daemon.log") < 60
        assert MAX_PER_UID < MAX_CONNECTIONS


def test_trickled_nul_and_nested_requests_are_refused_and_the_daemon_answers(
        store: Path, tmp_path: Path) -> None:
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    with daemon(store, tmp_path / "daemon.log", socket=sock) as guard:
        guard.wait_event("guard.started")
        assert wait_until(sock.exists, 10)
        # One byte a second: the request is cut at its deadline.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
            slow.connect(str(sock))
            start = time.monotonic()
            answer = b""
            for byte in b'{"method": "io.oomguard.List"' * 4:
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    break
                slow.settimeout(1.0)
                try:
                    answer += slow.recv(4096)
                except TimeoutError:
                    continue
                if answer:
                    break
            assert b"not completed within" in answer
            assert time.monotonic() - start < REQUEST_DEADLINE + 5
        # 64 KiB of NUL bytes: a few error replies, then the connection is closed.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as nul:
            nul.connect(str(sock))
            nul.sendall(b"\0" * 65536)
            nul.settimeout(10)
            data = b""
            while chunk := nul.recv(65536):
                data += chunk
            assert 1 <= data.count(b"\0") <= 9
        # Deeply nested JSON is refused like any malformed frame.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as deep:
            deep.connect(str(sock))
            deep.settimeout(10)
            deep.sendall(b"[" * 30_000 + b"]" * 30_000 + b"\0")
            data = deep.recv(65536)
            assert b"InvalidRequest" in data
        with ControlClient(sock) as root:
            assert root.call("List")["checkpoints"] == []
        assert guard.handle.poll() is None
        assert control_lines(tmp_path / "daemon.log") < 30
