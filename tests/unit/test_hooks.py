"""oomguard.observe.hooks: real /bin/sh hooks (environment, non-blocking fire, timeout kill) and the
sanitising of field names and values."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

from oomguard.observe.hooks import HookProcess, HookRunner, env_key, env_value, hook_environment

FIELDS: dict[str, object] = {"id": "ckpt-20240101-0001", "pid": 4321, "rss_bytes": 1 << 30}


def _env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key] = value
    return env


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_hook_sees_the_event_fields(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    hooks = HookRunner({"on_checkpoint": f"env > {shlex.quote(str(out))}"}, timeout=10)
    hooks.fire("on_checkpoint", FIELDS)
    assert hooks.join(10)
    env = _env_file(out)
    assert env["OOMGUARD_EVENT"] == "on_checkpoint"
    assert env["OOMGUARD_ID"] == "ckpt-20240101-0001"
    assert env["OOMGUARD_PID"] == "4321"
    assert env["OOMGUARD_RSS_BYTES"] == str(1 << 30)
    [run] = hooks.completed
    assert (run.event, run.result) == ("on_checkpoint", 0)
    assert run.seconds >= 0


def test_hook_runs_detached_with_stdin_from_dev_null(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    command = f"{{ cat; echo pgid=$(cut -d' ' -f5 /proc/$$/stat) pid=$$; }} > {shlex.quote(str(out))}"
    hooks = HookRunner({"on_restore": command}, timeout=10)
    hooks.fire("on_restore", {})
    assert hooks.join(10)
    text = out.read_text()
    # nothing read from stdin; the shell leads its own process group
    assert text.startswith("pgid=")
    pgid, pid = (part.split("=")[1] for part in text.split())
    assert pgid == pid


def test_fire_does_not_block(tmp_path: Path) -> None:
    pidfile = tmp_path / "hook.pid"
    done = tmp_path / "done"
    command = f"echo $$ > {shlex.quote(str(pidfile))}; sleep 2; touch {shlex.quote(str(done))}"
    hooks = HookRunner({"on_kill": command}, timeout=10)
    start = time.monotonic()
    hooks.fire("on_kill", {"pid": 1})
    elapsed = time.monotonic() - start
    assert elapsed < 0.5  # asserts "does not wait for the hook", not speed
    assert hooks.running == 1
    # the hook is underway; end it here rather than sit out its 2 s
    deadline = time.monotonic() + 5
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline, "hook never started"
        time.sleep(0.01)
    assert not done.exists()
    os.killpg(int(pidfile.read_text()), signal.SIGTERM)
    assert hooks.join(10)
    assert hooks.running == 0
    assert hooks.completed[-1].result == -signal.SIGTERM
    assert not done.exists()


def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    # the shell forks sleep into its group and waits: both must die
    command = f"sleep 30 & echo $! > {shlex.quote(str(pidfile))}; wait"
    hooks = HookRunner({"on_checkpoint": command}, timeout=0.5)
    start = time.monotonic()
    hooks.fire("on_checkpoint", {})
    assert hooks.join(10)
    assert time.monotonic() - start < 10
    [run] = hooks.completed
    assert run.result == "timeout"
    assert 0.5 <= run.seconds < 10
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def test_event_without_command_does_nothing() -> None:
    started: list[Sequence[str]] = []

    def runner(args: Sequence[str], **kwargs: object) -> HookProcess:
        started.append(args)
        raise AssertionError("nothing may start")

    hooks = HookRunner({"on_checkpoint": "true", "on_restore": "   "}, runner=runner)
    hooks.fire("on_kill", FIELDS)
    hooks.fire("on_restore", FIELDS)  # blank command: not configured
    hooks.fire("no_such_event", FIELDS)
    assert hooks.join(1)
    assert started == []
    assert list(hooks.completed) == []


def test_unknown_event_in_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="on_chekpoint"):
        HookRunner({"on_chekpoint": "true"})
    with pytest.raises(ValueError, match="timeout"):
        HookRunner({}, timeout=0)


def test_exit_status_and_output_tail_are_recorded() -> None:
    hooks = HookRunner({"on_kill": "echo something broke >&2; exit 3"}, timeout=10)
    hooks.fire("on_kill", {})
    assert hooks.join(10)
    [run] = hooks.completed
    assert run.result == 3
    assert run.detail == "something broke"


def test_start_failure_is_recorded_as_error() -> None:
    hooks = HookRunner({"on_kill": "true"}, shell="/nonexistent/sh", timeout=10)
    hooks.fire("on_kill", {})
    assert hooks.join(10)
    [run] = hooks.completed
    assert run.result == "error"
    assert "nonexistent" in run.detail


class _FakeProcess:
    pid = 999_999

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def wait(self, timeout: float | None = None) -> int:
        self.gate.wait(10)
        return 0


def test_at_most_max_running_then_dropped() -> None:
    gate = threading.Event()
    envs: list[Mapping[str, str]] = []

    def runner(args: Sequence[str], *, stdin: int, stdout: IO[bytes], stderr: IO[bytes],
               env: Mapping[str, str], start_new_session: bool, close_fds: bool) -> HookProcess:
        assert list(args)[:2] == ["/bin/sh", "-c"]
        assert stdin == subprocess.DEVNULL and start_new_session and close_fds
        envs.append(env)
        return _FakeProcess(gate)

    hooks = HookRunner({"on_checkpoint": "true"}, runner=runner, max_running=2, base_env={})
    for n in range(3):
        hooks.fire("on_checkpoint", {"n": n})
    assert hooks.dropped == 1
    assert not hooks.join(0.05)
    gate.set()
    assert hooks.join(10)
    assert len(hooks.completed) == 2
    assert sorted(env["OOMGUARD_N"] for env in envs) == ["0", "1"]


def test_completed_is_bounded() -> None:
    hooks = HookRunner({"on_kill": "true"}, keep=2, timeout=10)
    for n in range(3):
        hooks.fire("on_kill", {"n": n})
        assert hooks.join(10)
    assert len(hooks.completed) == 2


# -- sanitising -----------------------------------------------------------------------------------

def test_hostile_fields_are_sanitised(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    fields: dict[str, object] = {
        "name": "evil\nOOMGUARD_PID=1\r\0x",
        "a-b c": "spaced",
        "long": "y" * 100_000,
        "ok": True,
        "off": False,
        "ratio": 0.5,
        "path": Path("/x"),  # not a str/int/float/bool: left out
        "none": None,
        "nested": {"a": 1},
        "surrogate": "bad\udcffname\ud800",
        "event": "spoofed",
        "": "empty key",
    }
    env = hook_environment("on_kill", fields, base={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert env["OOMGUARD_NAME"] == "evilOOMGUARD_PID=1x"
    assert env["OOMGUARD_A_B_C"] == "spaced"
    assert len(env["OOMGUARD_LONG"]) == 4096
    assert (env["OOMGUARD_OK"], env["OOMGUARD_OFF"], env["OOMGUARD_RATIO"]) == ("1", "0", "0.5")
    assert "OOMGUARD_PATH" not in env and "OOMGUARD_NONE" not in env and "OOMGUARD_NESTED" not in env
    assert env["OOMGUARD_EVENT"] == "on_kill"
    assert "OOMGUARD_" not in env
    os.fsencode(env["OOMGUARD_SURROGATE"])  # encodable for execve

    # and a real shell receives them intact, one variable per line
    hooks = HookRunner({"on_kill": f"env > {shlex.quote(str(out))}"}, timeout=10)
    hooks.fire("on_kill", fields)
    assert hooks.join(10)
    assert hooks.completed[-1].result == 0
    got = _env_file(out)
    assert got["OOMGUARD_NAME"] == "evilOOMGUARD_PID=1x"
    assert "OOMGUARD_PID" not in got
    assert got["OOMGUARD_A_B_C"] == "spaced"
    assert got["OOMGUARD_LONG"] == "y" * 4096
    assert got["OOMGUARD_EVENT"] == "on_kill"


def test_inherited_protocol_and_stale_variables_are_withheld() -> None:
    base = {"PATH": "/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1",
            "WATCHDOG_PID": "1", "LISTEN_FDS": "1", "OOMGUARD_STALE": "x", "HOME": "/root"}
    env = hook_environment("on_restore", {"id": "c1"}, base)
    assert env == {"PATH": "/bin", "HOME": "/root", "OOMGUARD_ID": "c1", "OOMGUARD_EVENT": "on_restore"}


@pytest.mark.parametrize(
    ("key", "expected"),
    [("id", "OOMGUARD_ID"), ("a-b c", "OOMGUARD_A_B_C"), ("rss.bytes", "OOMGUARD_RSS_BYTES"),
     ("ünï", "OOMGUARD__N_"), ("9lives", "OOMGUARD_9LIVES"), ("x=y", "OOMGUARD_X_Y")],
)
def test_env_key(key: str, expected: str) -> None:
    assert env_key(key) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("a\nb", "ab"), ("a\0b", "ab"), (True, "1"), (0, "0"), (1.25, "1.25"), (None, None),
     (b"bytes", None), (["x"], None)],
)
def test_env_value(value: object, expected: str | None) -> None:
    assert env_value(value) == expected
