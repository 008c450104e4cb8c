"""oomguard.observe.dbus against real buses: two private dbus-daemons stand in for the system and
the session bus, and a small org.freedesktop.Notifications service (jeepney, in a thread) on
the "session" one records what the agent asks it to show."""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jeepney import (  # type: ignore[import-untyped]
    HeaderFields,
    MessageType,
    message_bus,
    new_error,
    new_method_return,
)
from jeepney.io.blocking import open_dbus_connection  # type: ignore[import-untyped]

from oomguard.observe import dbus as dbusnotify
from oomguard.observe.dbus import SignalEmitter, checkpointed_message, restored_message
from oomguard.observe.notifyagent import NotificationAgent, NotificationError

DBUS_DAEMON = shutil.which("dbus-daemon")
pytestmark = pytest.mark.skipif(DBUS_DAEMON is None, reason="dbus-daemon not installed")

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""

ME = 4242
CP_ID = "20261130-101500-4242"
COMMAND = "python3 train.py --epochs 10"
PID = 4242
RUN_GUARD_S = 10.0  # a run() that should end by itself is stopped after this long


@dataclass
class Bus:
    address: str
    process: subprocess.Popen[bytes]


def _start_bus(directory: Path, name: str) -> Bus:
    """`dbus-daemon --config-file=<dir>/<name>.conf --nofork --print-address=1`, with the
    config's <listen> on unix:path=<dir>/<name>; returns once the bus prints its address."""
    assert DBUS_DAEMON is not None
    config = directory / f"{name}.conf"
    config.write_text(BUS_CONFIG.format(socket=directory / name))
    proc = subprocess.Popen(
        [DBUS_DAEMON, f"--config-file={config}", "--nofork", "--print-address=1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 10.0)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail(f"dbus-daemon for the {name} bus did not start")
    return Bus(address=line, process=proc)


def _stop_bus(bus: Bus) -> None:
    if bus.process.poll() is None:
        bus.process.terminate()  # by PID: Popen signals its own child
        try:
            bus.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            bus.process.kill()
            bus.process.wait()
    if bus.process.stdout is not None:
        bus.process.stdout.close()


@dataclass
class Buses:
    system: Bus
    session: Bus
    directory: Path


@pytest.fixture
def buses() -> Iterator[Buses]:
    # A short directory: unix socket paths are limited to 107 bytes, pytest's tmp_path is long.
    directory = Path(tempfile.mkdtemp(prefix="oomg-dbus-", dir="/tmp"))
    started: list[Bus] = []
    try:
        started.append(_start_bus(directory, "system"))
        started.append(_start_bus(directory, "session"))
        yield Buses(system=started[0], session=started[1], directory=directory)
    finally:
        for bus in started:
            _stop_bus(bus)
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class NotificationServer:
    """org.freedesktop.Notifications on a bus: answers Notify with a fresh id and records its
    arguments, answers GetCapabilities with `capabilities`, and errors on anything else."""

    address: str
    capabilities: list[str] = field(default_factory=lambda: ["body"])
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    received: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _conn: Any = None

    def start(self) -> None:
        self._conn = open_dbus_connection(self.address)
        reply = self._conn.send_and_get_reply(
            message_bus.RequestName(dbusnotify.NOTIFICATIONS_NAME), timeout=5)
        assert reply.body == (1,), reply.body  # DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
        self._thread = threading.Thread(target=self._serve, name="notifications", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._conn is not None:
            self._conn.close()

    def _serve(self) -> None:
        conn = self._conn
        next_id = 1
        while not self._stop.is_set():
            try:
                msg = conn.receive(timeout=0.1)
            except TimeoutError:
                continue
            except OSError:
                return
            if msg.header.message_type != MessageType.method_call:
                continue
            member = msg.header.fields.get(HeaderFields.member)
            if member == "Notify":
                self.calls.append(tuple(msg.body))
                conn.send(new_method_return(msg, "u", (next_id,)))
                next_id += 1
                self.received.set()
            elif member == "GetCapabilities":
                conn.send(new_method_return(msg, "as", (self.capabilities,)))
            else:
                conn.send(new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod"))


@pytest.fixture
def server(buses: Buses) -> Iterator[NotificationServer]:
    srv = NotificationServer(buses.session.address)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def agent(buses: Buses) -> Iterator[NotificationAgent]:
    # The emitter in these tests runs as whoever runs the tests, not necessarily root.
    made = NotificationAgent(buses.system.address, buses.session.address, uid=ME,
                             trusted_sender_uids={os.getuid()}, poll_interval=0.1)
    made.subscribe()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def emitter(buses: Buses) -> Iterator[SignalEmitter]:
    made = SignalEmitter(buses.system.address)
    try:
        yield made
    finally:
        made.close()


def _run(agent: NotificationAgent, max_events: int | None, guard_s: float = RUN_GUARD_S) -> int:
    stop = threading.Event()
    timer = threading.Timer(guard_s, stop.set)
    timer.start()
    try:
        return agent.run(stop=stop, max_events=max_events)
    finally:
        timer.cancel()


# -- message text ---------------------------------------------------------------------------

def test_checkpointed_message_includes_the_restore_command() -> None:
    text = checkpointed_message(CP_ID, "python3 train.py", 4242)
    assert text == ("python3 train.py (pid 4242) was checkpointed to save memory; "
                    f"bring it back with: oomguard restore {CP_ID}")


def test_messages_are_one_line_and_valid_dbus_text() -> None:
    raw = "python3\0-c\0print('x')\nimport os\udcff"
    text = checkpointed_message("id with space", raw, 7)
    assert "\n" not in text and "\0" not in text
    text.encode("utf-8")  # no lone surrogates left
    assert text.endswith("oomguard restore 'id with space'")
    assert restored_message(CP_ID, "", 9) == f"process 9 was restored from checkpoint {CP_ID}"
    long = checkpointed_message(CP_ID, "x" * 1000, 1)
    assert len(long) < 400 and long.endswith(f"oomguard restore {CP_ID}")


# -- emitter -> agent -> notification -------------------------------------------------------

def test_checkpointed_signal_becomes_a_notification(
        emitter: SignalEmitter, agent: NotificationAgent, server: NotificationServer) -> None:
    assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
    assert _run(agent, max_events=1) == 1
    assert server.received.wait(5)
    assert len(server.calls) == 1
    app_name, replaces_id, icon, summary, body, actions, hints, expire = server.calls[0]
    assert (app_name, replaces_id, icon) == ("oomguard", 0, "")
    assert summary == "Checkpointed to save memory"
    assert body == checkpointed_message(CP_ID, COMMAND, PID)
    assert f"oomguard restore {CP_ID}" in body
    assert (actions, hints, expire) == ([], {}, -1)
    assert agent.notified == 1


def test_restored_signal_becomes_a_notification(
        emitter: SignalEmitter, agent: NotificationAgent, server: NotificationServer) -> None:
    assert emitter.emit_restored(ME, CP_ID, COMMAND, PID) is True
    assert _run(agent, max_events=1) == 1
    assert [(c[3], c[4]) for c in server.calls] == [
        ("Restored", restored_message(CP_ID, COMMAND, PID))]


def test_signal_for_another_uid_is_ignored(
        emitter: SignalEmitter, agent: NotificationAgent, server: NotificationServer) -> None:
    assert emitter.emit_checkpointed(ME + 1, "someone-else", "their-job", 1) is True
    assert emitter.emit_restored(ME, CP_ID, COMMAND, PID) is True
    assert _run(agent, max_events=1) == 1
    assert [c[3] for c in server.calls] == ["Restored"]
    assert "someone-else" not in server.calls[0][4]


def test_signal_from_an_untrusted_sender_is_ignored(
        buses: Buses, emitter: SignalEmitter, server: NotificationServer) -> None:
    with NotificationAgent(buses.system.address, buses.session.address, uid=ME,
                           trusted_sender_uids={os.getuid() + 1}, poll_interval=0.1) as picky:
        picky.subscribe()
        assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
        assert _run(picky, max_events=1, guard_s=1.0) == 0
    assert server.calls == []


def test_markup_is_escaped_when_the_server_takes_it(
        emitter: SignalEmitter, agent: NotificationAgent, server: NotificationServer) -> None:
    server.capabilities = ["body", "body-markup"]
    assert emitter.emit_restored(ME, CP_ID, "sh -c 'a < b && c'", PID) is True
    assert _run(agent, max_events=1) == 1
    assert "a &lt; b &amp;&amp; c" in server.calls[0][4]


def test_notify_without_a_notification_server_raises(
        buses: Buses, emitter: SignalEmitter, agent: NotificationAgent) -> None:
    assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
    with pytest.raises(NotificationError, match="ServiceUnknown"):
        _run(agent, max_events=1)


# -- emitter failure handling ---------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _counting(connect: Callable[[str], Any]) -> tuple[Callable[[str], Any], list[str]]:
    attempts: list[str] = []

    def wrapped(address: str) -> Any:
        attempts.append(address)
        return connect(address)

    return wrapped, attempts


def test_emitter_returns_false_when_the_bus_does_not_exist(tmp_path: Path) -> None:
    connect, attempts = _counting(dbusnotify.open_connection)
    clock = Clock()
    emitter = SignalEmitter(f"unix:path={tmp_path}/no-such-bus", connect=connect, clock=clock)
    assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is False
    assert isinstance(emitter.last_error, FileNotFoundError)
    assert attempts == [f"unix:path={tmp_path}/no-such-bus"]
    # Within the retry interval: no new attempt.
    clock.now += 59
    assert emitter.emit_restored(ME, CP_ID, COMMAND, PID) is False
    assert len(attempts) == 1
    # After it: one more.
    clock.now += 1
    assert emitter.emit_restored(ME, CP_ID, COMMAND, PID) is False
    assert len(attempts) == 2
    assert emitter.send_errors == 2
    emitter.close()


def test_emitter_survives_unusable_addresses() -> None:
    for address in ("tcp:host=localhost,port=1", "garbage", "unix:abstract=oomguard-test-none"):
        emitter = SignalEmitter(address)
        assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is False
        assert emitter.last_error is not None


def test_emitter_rejects_a_uid_out_of_range(emitter: SignalEmitter) -> None:
    with pytest.raises(ValueError):
        emitter.emit_checkpointed(-1, CP_ID, COMMAND, PID)


def test_emitter_reconnects_when_the_bus_comes_back() -> None:
    directory = Path(tempfile.mkdtemp(prefix="oomg-dbus-", dir="/tmp"))
    connect, attempts = _counting(dbusnotify.open_connection)
    clock = Clock()
    emitter = SignalEmitter(f"unix:path={directory}/system", connect=connect, clock=clock)
    try:
        assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is False  # no bus yet
        bus = _start_bus(directory, "system")
        try:
            assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is False  # throttled
            clock.now += 60
            assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
            assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
            assert len(attempts) == 2
        finally:
            _stop_bus(bus)
        # The bus went away: the dead connection is noticed, one reconnect fails, False.
        assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is False
        assert not emitter.connected
        bus = _start_bus(directory, "system")
        try:
            clock.now += 60
            assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
        finally:
            _stop_bus(bus)
    finally:
        emitter.close()
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def _frozen(bus: Bus) -> Iterator[None]:
    """The bus process stopped (SIGSTOP): its socket still accepts, nothing answers."""
    bus.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        bus.process.send_signal(signal.SIGCONT)


def test_emitter_gives_up_on_a_wedged_bus_in_bounded_time(buses: Buses) -> None:
    clock = Clock()
    emitter = SignalEmitter(buses.system.address, clock=clock,
                            connect=functools.partial(dbusnotify.open_connection, timeout=0.5))
    try:
        with _frozen(buses.system):
            started = time.monotonic()
            assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is False
            assert time.monotonic() - started < 3
            assert isinstance(emitter.last_error, TimeoutError)
        clock.now += 60
        assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
    finally:
        emitter.close()


def test_notification_fails_in_bounded_time_on_a_wedged_session_bus(
        buses: Buses, emitter: SignalEmitter) -> None:
    connect = functools.partial(dbusnotify.open_connection, timeout=0.5)
    with NotificationAgent(buses.system.address, buses.session.address, uid=ME,
                           trusted_sender_uids={os.getuid()}, connect=connect, timeout=0.5,
                           poll_interval=0.1) as agent:
        agent.subscribe()
        assert emitter.emit_checkpointed(ME, CP_ID, COMMAND, PID) is True
        with _frozen(buses.session), pytest.raises(NotificationError):
            _run(agent, max_events=1)
