"""Fuzzing the control socket as an unprivileged user (hypothesis, a bounded number of
examples): random bytes, random JSON, every method with random parameters. Every frame gets a
well-formed reply or the connection is closed for cause; afterwards the daemon still answers
root and still checkpoints a hog in the cgroup it guards."""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.control.client import ControlClient
from oomguard.control.protocol import INTERFACE, METHODS
from tests.helpers import CgroupFactory, MiB, daemon, hog_argv, short_socket_path, start_in_cgroup

pytestmark = pytest.mark.integration
FUZZER = 40021
PARAMETERS = ("id", "pid", "cgroup", "force", "reason", "wait", "timeout")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
calls = st.fixed_dictionaries(
    {"method": st.sampled_from([f"{INTERFACE}.{m}" for m in METHODS] + list(METHODS)
                               + ["org.varlink.service.GetInfo", "", "x" * 300, "../etc"])
     | st.text(max_size=30),
     "parameters": st.dictionaries(st.sampled_from(PARAMETERS) | st.text(max_size=10),
                                   json_values, max_size=5) | json_values})
frames = (calls.map(lambda c: json.dumps(c).encode())
          | st.binary(max_size=300).map(lambda b: b.replace(b"\0", b""))
          | st.text(max_size=200).map(str.encode).map(lambda b: b.replace(b"\0", b"")))


def connect_as(path: Path, uid: int) -> socket.socket:
    """A connection the daemon sees as `uid` (SO_PEERCRED is taken at connect time): a forked
    child drops to `uid`, connects, and hands the socket back over a socketpair."""
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(path))
            child_end.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [conn.fileno()]))])
            code = 0
        finally:
            os._exit(code)
    child_end.close()
    _, ancillary, _, _ = parent_end.recvmsg(1, socket.CMSG_LEN(4))
    os.waitpid(pid, 0)
    parent_end.close()
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:4])
    conn = socket.socket(fileno=fds[0])
    conn.settimeout(15)
    return conn


class FuzzClient:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.closed_for_cause = 0

    def send(self, frame: bytes) -> dict[str, Any] | None:
        """One frame -> the reply, or None when the daemon closed the connection for cause."""
        if self.sock is None:
            self.sock = connect_as(self.path, FUZZER)
        data = b""
        try:
            self.sock.sendall(frame + b"\0")
            while b"\0" not in data:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
        if b"\0" not in data:
            self.close()
            self.closed_for_cause += 1
            return None
        answer = json.loads(data.partition(b"\0")[0])
        assert isinstance(answer, dict)
        return answer

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = None


def test_fuzzed_frames_get_replies_and_the_daemon_keeps_guarding(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("fuzz", 256 * MiB)
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path), socket=sock) as guard:
        guard.wait_event("guard.armed")
        client = FuzzClient(sock)

        @settings(max_examples=400, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(frame=frames)
        def one_frame(frame: bytes) -> None:
            answer = client.send(frame)
            if answer is not None:
                assert "error" in answer or "parameters" in answer, answer
                if "error" in answer:
                    assert isinstance(answer["parameters"]["message"], str)
            assert guard.handle.poll() is None, "the daemon died"

        try:
            one_frame()
        finally:
            client.close()
        with ControlClient(sock) as root:
            assert root.call("Status")["status"]["guards"]
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                           count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == hog.pid
        hog.wait(timeout=10)
        assert cg.snapshot().oom_kills == 0
        assert guard.handle.poll() is None
