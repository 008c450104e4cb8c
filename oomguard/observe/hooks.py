"""earlyoom-style hooks: a shell command run when oomguard checkpoints, restores or kills.

`HookRunner.fire(event, fields)` returns at once; the command runs as `/bin/sh -c COMMAND`
from a background thread, in a session of its own (its own process group), stdin from
/dev/null, with the event's fields in its environment as OOMGUARD_<KEY>=value plus
OOMGUARD_EVENT=<event>. A hook that outlasts the timeout has its process group SIGKILLed.
Each finished run is recorded (`completed`) for the status command and for tests; nothing is
logged here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Literal, Protocol

EVENTS = ("on_checkpoint", "on_restore", "on_kill")
SHELL = "/bin/sh"
MAX_VALUE_CHARS = 4096  # far under execve's 128 KiB per string, plenty for a path or a name
STDERR_TAIL_BYTES = 2048

# Inherited variables a hook must not see: the service manager's protocols are meant for
# oomguard's own pid, and stale OOMGUARD_* values would be mistaken for the event's fields.
_WITHHELD = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
             "LISTEN_FDNAMES")

_KEY_JUNK = re.compile(r"[^A-Z0-9_]")


class HookProcess(Protocol):
    """The part of subprocess.Popen a hook run uses."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ProcessFactory(Protocol):
    """How a hook is started; subprocess.Popen in production."""

    def __call__(self, args: Sequence[str], *, stdin: int, stdout: IO[bytes], stderr: IO[bytes],
                 env: Mapping[str, str], start_new_session: bool,
                 close_fds: bool) -> HookProcess: ...


@dataclass(frozen=True)
class HookRun:
    """One finished hook: its exit status (negative: killed by that signal), "timeout" when
    it was killed for outlasting the timeout, or "error" when it could not be started
    (`detail` says why). `detail` otherwise holds the tail of what it wrote."""

    event: str
    result: int | Literal["timeout", "error"]
    seconds: float
    detail: str = ""


def env_key(key: str) -> str:
    """'a-b c' -> 'OOMGUARD_A_B_C'."""
    return "OOMGUARD_" + _KEY_JUNK.sub("_", key.upper())


def env_value(value: object, max_chars: int = MAX_VALUE_CHARS) -> str | None:
    """The environment form of a field value; None for types that are not passed on.
    Booleans become 1/0. Newlines, carriage returns and NULs are removed, long text is
    cut, and text the filesystem encoding cannot carry (lone surrogates) is replaced."""
    if isinstance(value, bool):
        text = "1" if value else "0"
    elif isinstance(value, int | float | str):
        text = str(value)
    else:
        return None
    text = text.replace("\0", "").replace("\n", "").replace("\r", "")[:max_chars]
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        text = text.encode(sys.getfilesystemencoding(), "replace").decode(
            sys.getfilesystemencoding())
    return text


def hook_environment(event: str, fields: Mapping[str, object], base: Mapping[str, str],
                     max_chars: int = MAX_VALUE_CHARS) -> dict[str, str]:
    """`base` without the withheld variables and any OOMGUARD_*, then the fields, then
    OOMGUARD_EVENT (which a field named 'event' cannot override)."""
    env = {k: v for k, v in base.items() if k not in _WITHHELD and not k.startswith("OOMGUARD_")}
    for key, value in fields.items():
        name = env_key(str(key))
        text = env_value(value, max_chars)
        if text is not None and name != "OOMGUARD_":
            env[name] = text
    env["OOMGUARD_EVENT"] = event
    return env


def _tail(stream: IO[bytes], limit: int = STDERR_TAIL_BYTES) -> str:
    stream.seek(0, os.SEEK_END)
    size = stream.tell()
    stream.seek(max(0, size - limit))
    return stream.read().decode(errors="replace").strip()


class HookRunner:
    """Runs the configured command for an event without blocking the caller.

    `commands` maps event names (EVENTS) to shell commands; an empty command is the same as
    none. At most `max_running` hooks run at once; a fire() beyond that is dropped and
    counted in `dropped` (under memory pressure a storm of shells would not help).
    """

    def __init__(self, commands: Mapping[str, str], timeout: float = 30.0,
                 runner: ProcessFactory = subprocess.Popen, *, base_env: Mapping[str, str] | None = None,
                 max_running: int = 8, keep: int = 50, shell: str = SHELL,
                 clock: Callable[[], float] = time.monotonic,
                 on_done: Callable[[HookRun], None] | None = None) -> None:
        unknown = sorted(set(commands) - set(EVENTS))
        if unknown:
            raise ValueError(f"unknown hook event(s): {', '.join(unknown)} (known: {', '.join(EVENTS)})")
        if timeout <= 0:
            raise ValueError(f"hook timeout must be positive, not {timeout}")
        self.commands = {event: cmd for event, cmd in commands.items() if cmd.strip()}
        self.timeout = timeout
        self.completed: deque[HookRun] = deque(maxlen=keep)
        self.dropped = 0
        self.max_running = max_running
        self._runner = runner
        self._base_env = base_env
        self._shell = shell
        self._clock = clock
        self.on_done = on_done  # told of each finished run (the daemon logs it)
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._threads)

    def fire(self, event: str, fields: Mapping[str, object]) -> None:
        """Start the hook for `event`, if one is configured, and return at once."""
        command = self.commands.get(event)
        if command is None:
            return
        base = os.environ if self._base_env is None else self._base_env
        env = hook_environment(event, fields, base)
        with self._lock:
            if len(self._threads) >= self.max_running:
                self.dropped += 1
                return
            thread = threading.Thread(target=self._run, args=(event, command, env),
                                      name=f"oomguard-hook-{event}", daemon=True)
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError:  # can't start new thread
            with self._lock:
                self._threads.discard(thread)
                self.dropped += 1

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the running hooks (those started so far); True if none is left running."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            remaining = None if deadline is None else max(0.0, deadline - self._clock())
            thread.join(remaining)
        return self.running == 0

    def _run(self, event: str, command: str, env: dict[str, str]) -> None:
        started = self._clock()
        run = HookRun(event, "error", 0.0, "did not finish")
        try:
            run = self._execute(event, command, env, started)
        except Exception as exc:  # a hook must never take a daemon thread down silently
            run = HookRun(event, "error", self._clock() - started, f"{type(exc).__name__}: {exc}")
        finally:
            # recorded before the thread counts as finished, so join() sees the record
            with self._lock:
                self.completed.append(run)
                self._threads.discard(threading.current_thread())
            if self.on_done is not None:
                with contextlib.suppress(Exception):
                    self.on_done(run)

    def _execute(self, event: str, command: str, env: dict[str, str], started: float) -> HookRun:
        with tempfile.TemporaryFile() as output:
            try:
                proc = self._runner([self._shell, "-c", command], stdin=subprocess.DEVNULL,
                                    stdout=output, stderr=output, env=env,
                                    start_new_session=True, close_fds=True)
            except OSError as exc:
                return HookRun(event, "error", self._clock() - started, str(exc))
            result: int | Literal["timeout"]
            try:
                result = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                # start_new_session: the shell leads its own group, and is not yet reaped,
                # so the group id cannot have been reused.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                result = "timeout"
            return HookRun(event, result, self._clock() - started, _tail(output))

