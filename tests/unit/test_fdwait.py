"""oomguard.sense.fdwait: readiness of descriptors numbered past select()'s FD_SETSIZE."""

from __future__ import annotations

import os
import resource
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.sense.fdwait import wait_readable
from oomguard.store.hookgate import Gate

HIGH = 1500  # above FD_SETSIZE (1024)


@pytest.fixture
def room() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HIGH + 100:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {HIGH + 100}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 100), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_pipe_numbered_past_fd_setsize(room: None) -> None:
    read_end, write_end = os.pipe()
    high = os.dup2(read_end, HIGH)
    os.close(read_end)
    try:
        assert not wait_readable(high, 0.01)
        os.write(write_end, b"x")
        assert wait_readable(high, 0.0)
        assert os.read(high, 1) == b"x"
        os.close(write_end)
        assert wait_readable(high, 1.0)  # hung up: readable, the read says end of file
        assert os.read(high, 1) == b""
    finally:
        os.close(high)


def test_a_socket_object_and_no_timeout(room: None) -> None:
    left, right = socket.socketpair()
    try:
        threading.Timer(0.05, right.send, [b"y"]).start()
        assert wait_readable(left, None)
        assert left.recv(1) == b"y"
    finally:
        left.close()
        right.close()


def test_a_gate_opened_past_fd_setsize_still_hears_its_request(room: None,
                                                               tmp_path: Path) -> None:
    crowd = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with Gate(tmp_path, ".g") as gate:
            assert gate.request_fd > 1024
            assert gate.request(0.0) is None
            with open(gate.request_path, "w") as request:
                request.write("finish\n")
            assert gate.request(1.0) == "finish"
    finally:
        for fd in crowd:
            os.close(fd)
