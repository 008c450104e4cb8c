"""oomguard.observe.sdnotify: datagrams to a real AF_UNIX socket, abstract addresses, the watchdog
interval, and the no-op and error paths."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import oomguard.observe.sdnotify as sdnotify
from oomguard.observe.sdnotify import Notifier, socket_address

SUN_PATH_MAX = 107  # sizeof(sun_path) - 1 for the terminating NUL


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short directory when tmp_path would overflow sun_path."""
    if len(str(tmp_path / "notify.sock")) <= SUN_PATH_MAX:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="sdn", dir="/tmp"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)
    return sock


def _received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_datagrams_arrive_in_order(sock_dir: Path) -> None:
    path = str(sock_dir / "notify.sock")
    with _receiver(path) as rx:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
        assert notifier.enabled
        assert notifier.ready("watching 3 cgroups")
        assert notifier.status("checkpointed 1234")
        assert notifier.watchdog()
        assert notifier.stopping()
        assert [_received(rx) for _ in range(4)] == [
            "READY=1\nSTATUS=watching 3 cgroups",
            "STATUS=checkpointed 1234",
            "WATCHDOG=1",
            "STOPPING=1",
        ]
    assert notifier.send_errors == 0


def test_abstract_socket() -> None:
    name = f"oomguard-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as rx:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.address == "\0" + name
        assert notifier.watchdog()
        assert _received(rx) == "WATCHDOG=1"


def test_status_text_cannot_inject_assignments(sock_dir: Path) -> None:
    path = str(sock_dir / "notify.sock")
    with _receiver(path) as rx:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
        notifier.ready("ok\nSTOPPING=1\0")
        notifier.status("a\r\nb")
        assert _received(rx) == "READY=1\nSTATUS=ok STOPPING=1"
        assert _received(rx) == "STATUS=a  b"


def test_no_notify_socket_is_a_noop() -> None:
    def no_socket() -> socket.socket:
        raise AssertionError("no socket may be opened without NOTIFY_SOCKET")

    for environ in ({}, {"NOTIFY_SOCKET": ""}):
        notifier = Notifier.from_env(environ, socket_factory=no_socket)
        assert not notifier.enabled
        assert not notifier.ready("up")
        assert not notifier.status("x")
        assert not notifier.watchdog()
        assert not notifier.stopping()
        assert notifier.watchdog_interval() is None
        assert notifier.send_errors == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("/run/systemd/notify", "/run/systemd/notify"), ("@abs", "\0abs"), ("", None), ("@", None),
     ("relative/path", None), ("vsock:2:1234", None)],
)
def test_socket_address(value: str, expected: str | None) -> None:
    assert socket_address(value) == expected


def test_unsupported_address_is_a_noop() -> None:
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).ready("up")


def test_send_errors_are_swallowed_and_counted(sock_dir: Path) -> None:
    missing = Notifier.from_env({"NOTIFY_SOCKET": str(sock_dir / "absent.sock")})
    assert not missing.ready("up")
    assert not missing.watchdog()
    assert missing.send_errors == 2
    assert isinstance(missing.last_error, FileNotFoundError)

    # bound once, then closed: the file stays, nobody listens -> ECONNREFUSED
    stale = str(sock_dir / "stale.sock")
    _receiver(stale).close()
    refused = Notifier.from_env({"NOTIFY_SOCKET": stale})
    assert not refused.stopping()
    assert refused.send_errors == 1
    assert isinstance(refused.last_error, ConnectionRefusedError)


def test_socket_is_close_on_exec(sock_dir: Path) -> None:
    made: list[socket.socket] = []

    def factory() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        made.append(sock)
        assert not os.get_inheritable(sock.fileno())
        return sock

    path = str(sock_dir / "notify.sock")
    with _receiver(path) as rx:
        assert Notifier.from_env({"NOTIFY_SOCKET": path}, socket_factory=factory).watchdog()
        assert _received(rx) == "WATCHDOG=1"
    assert made and made[0].fileno() == -1  # closed after the send


def test_default_socket_is_close_on_exec() -> None:
    with sdnotify._dgram_socket() as sock:
        assert not os.get_inheritable(sock.fileno())
        assert sock.type == socket.SOCK_DGRAM


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "20000000"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "4242"}, 10.0),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": " 4242\n"}, 1.5),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}, None),  # someone else's
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "pid"}, None),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": ""}, None),
        ({"WATCHDOG_USEC": "garbage"}, None),
        ({"WATCHDOG_USEC": "2e7"}, None),
        ({"WATCHDOG_USEC": "-20000000"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "\u00b2"}, None),  # str.isdigit() is true for superscript two
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify", **environ},
                                 getpid=lambda: 4242)
    assert notifier.watchdog_interval() == expected


def test_watchdog_interval_with_real_pid() -> None:
    environ = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "20000000",
               "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(environ).watchdog_interval() == 10.0
    environ["WATCHDOG_PID"] = str(os.getpid() + 1)
    assert Notifier.from_env(environ).watchdog_interval() is None


def test_watchdog_interval_needs_notify_socket() -> None:
    assert Notifier.from_env({"WATCHDOG_USEC": "20000000"}).watchdog_interval() is None
