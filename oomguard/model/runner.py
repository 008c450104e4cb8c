"""The command runner: how oomguard starts external programs (CRIU). Injected so tests can swap it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
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
    on timeout its whole process group is SIGKILLed. Output goes to unlinked temporary files,
    not pipes: if oomguard dies, CRIU is not killed by SIGPIPE half way through a dump, and
    finishes (or fails and resumes the tree) on its own."""

    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None,
            pass_fds: Sequence[int] = ()) -> CommandResult:
        full_env = None if env is None else {**os.environ, **env}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                env=full_env, start_new_session=True, pass_fds=tuple(pass_fds),
            )
            # A blocking wait, woken by the exit itself: Popen.wait(timeout) polls with sleeps
            # of up to 50 ms, which a 0.2 s restore noticed. The timeout is a timer's.
            expired = threading.Event()

            def expire() -> None:
                expired.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            timer = threading.Timer(timeout, expire) if timeout is not None else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            try:
                proc.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            timed_out = expired.is_set()
            out.seek(0)
            err.seek(0)
            stdout = out.read().decode(errors="replace")
            stderr = err.read().decode(errors="replace")
        code = -signal.SIGKILL if timed_out else proc.returncode
        return CommandResult(tuple(argv), code, stdout, stderr, timed_out=timed_out)


def executable_candidates(configured: str | None, env_var: str, usual: Sequence[str],
                          name: str) -> list[str]:
    """Where to look for a helper program (CRIU, cuda-checkpoint), in order: the configured
    path alone if one is given ("auto": none), else $ENV_VAR, the usual places, then $PATH."""
    if configured and configured != "auto":
        return [configured]
    env = os.environ.get(env_var)
    found = ([env] if env else []) + list(usual)
    on_path = shutil.which(name)
    if on_path:
        found.append(on_path)
    return list(dict.fromkeys(found))
