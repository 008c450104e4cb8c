"""oomguard.observe.journal: the "<N>"-prefixed JSON renderer and the $JOURNAL_STREAM check."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from oomguard.observe.journal import priority_for, syslog_prefix_renderer, under_journald


def _split(line: str) -> tuple[int, dict[str, Any]]:
    assert line.startswith("<") and line[2] == ">", line
    return int(line[1]), json.loads(line[3:])


@pytest.mark.parametrize(
    ("level", "priority"),
    [("critical", 3), ("exception", 3), ("error", 3), ("warning", 4), ("warn", 4),
     ("notice", 5), ("info", 6), ("debug", 7), ("WARNING", 4), ("bogus", 6)],
)
def test_priority_per_level(level: str, priority: int) -> None:
    render = syslog_prefix_renderer()
    prio, body = _split(render(None, "info", {"event": "x", "level": level}))
    assert prio == priority
    assert body["level"] == level
    assert priority_for(level) == priority


def test_level_falls_back_to_method_name() -> None:
    render = syslog_prefix_renderer()
    assert render(None, "error", {"event": "x"}).startswith("<3>{")
    assert render(None, "debug", {"event": "x", "level": 7}).startswith("<7>{")


def test_default_priority() -> None:
    assert syslog_prefix_renderer(default_priority=5)(None, "trace", {"event": "x"}).startswith("<5>")


def test_json_holds_event_and_fields_on_one_line() -> None:
    render = syslog_prefix_renderer()
    line = render(None, "warning", {"event": "checkpoint.failed", "level": "warning", "pid": 4321,
                                    "reason": "criu said:\nno\0pe", "path": Path("/var/lib/x")})
    assert "\n" not in line
    prio, body = _split(line)
    assert prio == 4
    assert body == {"event": "checkpoint.failed", "level": "warning", "pid": 4321,
                    "reason": "criu said:\nno\0pe", "path": "PosixPath('/var/lib/x')"}


def test_bytes_serializer_is_decoded() -> None:
    def dumps(obj: Any, **kw: Any) -> bytes:
        return json.dumps(obj, **kw).encode()

    line = syslog_prefix_renderer(serializer=dumps)(None, "info", {"event": "x"})
    assert isinstance(line, str)
    assert _split(line) == (6, {"event": "x"})


def test_in_a_structlog_chain() -> None:
    out = io.StringIO()
    logger = structlog.wrap_logger(
        structlog.PrintLogger(out),
        processors=[structlog.processors.add_log_level, syslog_prefix_renderer()],
    )
    logger.error("victim.chosen", pid=7)
    logger.info("threshold.crossed", cgroup="/a")
    lines = out.getvalue().splitlines()
    assert [_split(line) for line in lines] == [
        (3, {"event": "victim.chosen", "pid": 7, "level": "error"}),
        (6, {"event": "threshold.crossed", "cgroup": "/a", "level": "info"}),
    ]


# -- under_journald ------------------------------------------------------------------------------

@pytest.fixture
def stream_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def test_under_journald_for_matching_fd(stream_fd: int) -> None:
    st = os.fstat(stream_fd)
    assert under_journald({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stream_fd)


def test_not_under_journald_for_another_file(stream_fd: int, tmp_path: Path) -> None:
    st = os.fstat(stream_fd)
    other = os.stat(tmp_path)
    assert not under_journald({"JOURNAL_STREAM": f"{st.st_dev}:{other.st_ino}"}, stream_fd)
    assert not under_journald({"JOURNAL_STREAM": f"{st.st_dev + 1}:{st.st_ino}"}, stream_fd)


@pytest.mark.parametrize(
    "value",
    [None, "", ":", "garbage", "12", "12:", ":34", "a:b", "1:2:3", "-1:5", "0x1:0x2", "\u00b9:\u00b2"],
)
def test_not_under_journald_for_absent_or_garbage(value: str | None, stream_fd: int) -> None:
    environ = {} if value is None else {"JOURNAL_STREAM": value}
    assert not under_journald(environ, stream_fd)


def test_not_under_journald_for_a_closed_fd(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "gone", os.O_WRONLY | os.O_CREAT, 0o600)
    st = os.fstat(fd)
    os.close(fd)
    assert not under_journald({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, fd)


def _parse_native(data: bytes) -> dict[str, str]:
    """journald's native protocol, read back as journald reads it."""
    fields: dict[str, str] = {}
    while data:
        line_end = data.index(b"\n")
        head = data[:line_end]
        if b"=" in head:
            name, _, value = head.partition(b"=")
            data = data[line_end + 1:]
        else:  # NAME\n, 64-bit little-endian length, the value, \n
            name = head
            size = int.from_bytes(data[line_end + 1:line_end + 9], "little")
            value = data[line_end + 9:line_end + 9 + size]
            assert data[line_end + 9 + size:line_end + 10 + size] == b"\n"
            data = data[line_end + 10 + size:]
        assert name.decode().replace("_", "").isalnum() and name.isupper(), name
        fields[name.decode()] = value.decode()
    return fields


def test_events_go_to_journald_as_a_human_message_and_fields(tmp_path: Path) -> None:
    import socket as socketlib

    from oomguard.observe.journal import JournalLoggerFactory, journal_renderer

    path = tmp_path / "socket"
    server = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(5)
    fallback = io.StringIO()
    log = structlog.wrap_logger(
        JournalLoggerFactory(path, fallback)(),
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), journal_renderer])
    log.warning("checkpoint.done", pid=4242, uid=1000, id="20261203-1-4242",
                cgroup="/user.slice/user-1000.slice", freed=300 << 20,
                error="CRIU said:\nline two", ok=True, extra={"a": 1},
                explanation="the job is on disk")
    fields = _parse_native(server.recv(1 << 16))
    server.close()
    assert fallback.getvalue() == ""
    message = fields["MESSAGE"]
    assert "\n" not in message and "{" not in message, message
    assert message.startswith("checkpoint.done: cgroup=/user.slice/user-1000.slice "
                              "id=20261203-1-4242 pid=4242"), message
    assert "freed=300.0MiB" in message and "extra=a:1" in message
    assert message.endswith("(the job is on disk)"), message
    assert fields["PRIORITY"] == "4" and fields["SYSLOG_IDENTIFIER"] == "oomguard"
    assert fields["OOMGUARD_EVENT"] == "checkpoint.done"
    assert fields["CHECKPOINT_ID"] == "20261203-1-4242"
    assert (fields["OOMGUARD_PID"], fields["OOMGUARD_UID"]) == ("4242", "1000")
    assert fields["OOMGUARD_CGROUP"] == "/user.slice/user-1000.slice"
    assert fields["OOMGUARD_FREED"] == str(300 << 20)
    assert fields["OOMGUARD_ERROR"] == "CRIU said:\nline two"  # sent with its length
    assert (fields["OOMGUARD_OK"], fields["OOMGUARD_EXTRA"]) == ("true", '{"a": 1}')
    assert "OOMGUARD_TIMESTAMP" not in fields and "OOMGUARD_LEVEL" not in fields


def test_without_journald_socket_the_line_goes_to_the_stream(tmp_path: Path) -> None:
    from oomguard.observe.journal import JournalLoggerFactory, journal_renderer

    fallback = io.StringIO()
    log = structlog.wrap_logger(
        JournalLoggerFactory(tmp_path / "absent", fallback)(),
        processors=[structlog.processors.add_log_level, journal_renderer])
    log.info("guard.armed", cgroup="/a")
    prio, body = _split(fallback.getvalue().strip())
    assert prio == 6 and body["event"] == "guard.armed" and body["cgroup"] == "/a"


@pytest.mark.parametrize(("key", "name"), [("id", "CHECKPOINT_ID"),
                                           ("usage-after", "OOMGUARD_USAGE_AFTER"),
                                           ("job.pid", "OOMGUARD_JOB_PID")])
def test_field_names_are_journal_names(key: str, name: str) -> None:
    from oomguard.observe.journal import field_name

    assert field_name(key) == name
