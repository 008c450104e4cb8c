"""The CLI's terminal commands: `exec` (with its "was it checkpointed?" question to the store),
`attach ID|PID`, and attaching after `restore` on a terminal."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.model.errors import OomguardError
from oomguard.store.ids import names_a_pid
from oomguard.terminal.attach import ENDED, GONE, HANGUP, PINNED, attach_session
from oomguard.terminal.client import SYSTEM_DIR, HolderError, connect_attach, request, runtime_dir
from oomguard.terminal.execwrap import EXIT_CHECKPOINTED, ExecJob
from oomguard.terminal.external import SOCKET_ENV, TTYS, environ_value
from oomguard.terminal.shelljob import SHELL_TTY
from oomguard.terminal.wire import describe_end, shell_status

Call = Callable[..., dict[str, Any]]
CHECKPOINT_WAIT = 15.0  # CRIU kills the tree, then the checkpoint is committed


def checkpoint_finder(call: Call, wait: float = CHECKPOINT_WAIT) -> Callable[[int], str | None]:
    def find(pid: int) -> str | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                metas = call("List")["checkpoints"]
            except (OomguardError, OSError):
                return None  # no daemon and no store of ours to read: we cannot tell
            for meta in metas:
                if meta.get("pid") == pid and meta.get("state") == "checkpointed":
                    return str(meta["id"])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
    return find


def run_exec(command: list[str], cgroup_procs: Path | None, call: Call) -> int:
    return ExecJob(command, cgroup_procs, checkpoint_finder(call)).run()


def holder_of_checkpoint(meta: dict[str, Any]) -> str | None:
    """The socket of the holder of the job's terminal: `oomguard exec`'s, or the one a
    restore of a job typed at a shell prompt gave it."""
    extra = meta.get("extra") or {}
    shell = extra.get(SHELL_TTY)
    if isinstance(shell, dict) and shell.get("socket") and meta.get("state") == "restored":
        return str(shell["socket"])
    ttys = extra.get(TTYS) or []
    return next((t["socket"] for t in ttys if t.get("socket")), None)


PTS_MAJORS = range(136, 144)  # Unix98 pty slaves (/dev/pts/N)


def _tty_keys(pid: int) -> tuple[str | None, set[str]]:
    """(the key of the pty on the process's stdin/stdout/stderr, or None; the keys of every
    pty slave it has open) as a holder names its pty: tty[RDEV:DEV]."""
    first: str | None = None
    keys: set[str] = set()
    with contextlib.suppress(OSError):
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=lambda name: int(name))
        for fd in fds:
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if os.major(st.st_rdev) in PTS_MAJORS:
                    key = f"tty[{st.st_rdev:x}:{st.st_dev:x}]"
                    keys.add(key)
                    if first is None and int(fd) <= 2:
                        first = key
    return first, keys


def holder_of_pid(pid: int) -> str | None:
    """The holder of the process's own terminal: the one whose pty the process has open (on
    its stdin/stdout/stderr first), the holder its environment names first among those that
    answer, then any holder of ours (one restored onto a new pty). Never a holder of a pty
    the process does not have open: its environment may name any holder (inherited from
    another job), and another holder of the same user is another job's."""
    primary, keys = _tty_keys(pid)
    if not keys:
        return None
    candidates: list[str] = []
    with contextlib.suppress(OSError):
        named = environ_value(Path(f"/proc/{pid}/environ").read_bytes(), SOCKET_ENV)
        if named:
            candidates.append(named)
    for directory in {runtime_dir(os.getuid()), SYSTEM_DIR / str(os.getuid())}:
        with contextlib.suppress(OSError):
            candidates += sorted(str(p) for p in directory.glob("tty-*.sock"))
    fallback = None
    for path in dict.fromkeys(candidates):
        try:
            info = request(path, "info", timeout=1.0)
        except HolderError:
            continue
        if info.get("key") == primary:
            return path
        if fallback is None and info.get("key") in keys:
            fallback = path
    return fallback


def attach_to(path: str, say: Callable[[str], None] | None = None) -> int:
    """Show the job's terminal here until the job ends (its exit status is ours, as a shell's
    `fg`), is checkpointed, or the user detaches (0)."""
    tell = say or (lambda text: print(f"oomguard: {text}", file=sys.stderr, flush=True))
    sock, info = connect_attach(path)
    stdin_fd = 0 if os.isatty(0) else None
    with sock:
        why, client = attach_session(sock, info, stdin_fd, 1)
    state = client.state
    if why == ENDED:
        tell(f"the job {describe_end(state)}")
        return shell_status(state)
    if why == PINNED:
        tell(f"the job was checkpointed as {state.pinned}; `oomguard restore {state.pinned}` "
             "brings it back")
        return EXIT_CHECKPOINTED
    if why == GONE:
        tell("the job's terminal closed")
        return 0
    if why == HANGUP:
        return 0
    tell(f"detached; `oomguard attach` again any time ({path})")
    return 0


def attach(target: str, call: Call, job_of: Callable[[int], int] = lambda pid: pid) -> int:
    """`job_of(pid)`: the init of the `oomguard exec` job a PID is in (it holds the job's
    terminal and names its holder), else the PID (oomguard.lifecycle.jobroot.job_process)."""
    if names_a_pid(target):  # any process of an exec job: its init's terminal, else its own
        path = holder_of_pid(job_of(int(target))) or holder_of_pid(int(target))
        if path is None:
            raise HolderError(f"process {target} has no terminal oomguard holds (jobs started "
                              "on a terminal with `oomguard exec`, and jobs restored after "
                              "they were typed at a shell prompt, have one)")
    else:
        meta = call("Show", id=target)["checkpoint"]
        path = holder_of_checkpoint(meta)
        checkpoint_id = meta.get("id", target)
        if path is None and SHELL_TTY in (meta.get("extra") or {}):
            raise HolderError(f"checkpoint {checkpoint_id} is not running: `oomguard restore "
                              f"{checkpoint_id}` brings it back on a new terminal (and shows "
                              "it there when run on one)")
        if path is None:
            raise HolderError(f"checkpoint {checkpoint_id} had no terminal")
    return attach_to(path)
