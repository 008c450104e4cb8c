"""The command runner: how oomguard starts external programs (CRIU). Injected so tests can swap it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None,
            pass_fds: Sequence[int] = ()) -> CommandResult: ...


class SubprocessRunner:
    """Runs a command in a new session (setsid: what it starts does not belong to ours);
    on timeout its whole process group is SIGKILLed."""

    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None,
            pass_fds: Sequence[int] = ()) -> CommandResult:
        full_env = None if env is None else {**os.environ, **env}
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=full_env, start_new_session=True, text=True, errors="replace",
            pass_fds=tuple(pass_fds),
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return CommandResult(tuple(argv), -signal.SIGKILL, out, err, timed_out=True)
        return CommandResult(tuple(argv), proc.returncode, out, err)
