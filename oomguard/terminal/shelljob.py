"""Jobs typed at a shell prompt: their terminal belongs to the shell's session, led outside
the tree oomguard dumps. CRIU dumps such a tree with --shell-job, and restores it only onto the
terminal of the session its own process runs in (its standard input), so a restore gives the
job a new pty whose holder leads that session (oomguard/terminal/leader.py).

What CRIU cannot restore is said before anything is stopped (`refusal`): a tree spread over
two sessions led outside it, a task in an outside process group that is not the root's, two
terminals of outside sessions. Pure functions over what the sensor read (`TaskTerminal`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.terminal.external import (
    fdinfo_tty_index,
    format_key,
    pts_index,
)

SHELL_TTY = "shell_tty"  # meta.extra: {"key", "index", "socket"}: the terminal the job had


@dataclass(frozen=True)
class TaskTerminal:
    """Of one task: its session, process group and controlling terminal (stat), the pts
    slaves it holds ((rdev, dev, index)) and the pty masters (their indexes)."""

    pid: int
    comm: str
    session: int
    pgrp: int
    tty_nr: int
    slaves: tuple[tuple[int, int, int], ...] = ()
    masters: tuple[int, ...] = ()


@dataclass(frozen=True)
class ShellTty:
    """The terminal of a session led outside the tree that the tree's tasks hold."""

    rdev: int
    dev: int
    index: int
    socket: str | None = None  # an oomguard holder serving it (a job restored before)

    @property
    def key(self) -> str:
        return format_key(self.rdev, self.dev)

    @property
    def path(self) -> str:
        return f"/dev/pts/{self.index}"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "index": self.index, "socket": self.socket}


def led_outside(tasks: Sequence[TaskTerminal]) -> bool:
    """Whether some task's session is led outside the tree (a job typed at a prompt)."""
    pids = {t.pid for t in tasks}
    return any(t.session not in pids for t in tasks)


def outside_terminals(tasks: Sequence[TaskTerminal]) -> list[tuple[int, int, int]]:
    """The pts slaves the tree holds whose master it does not hold and which no session led
    inside the tree controls (those are CRIU's external terminals: oomguard exec's)."""
    inside_ctty = {t.tty_nr for t in tasks if t.session == t.pid and t.tty_nr}
    masters = {index for t in tasks for index in t.masters}
    found: dict[int, tuple[int, int, int]] = {}
    for task in tasks:
        for rdev, dev, index in task.slaves:
            if index in masters or rdev in inside_ctty:
                continue
            found.setdefault(index, (rdev, dev, index))
    return [found[i] for i in sorted(found)]


def refusal(tasks: Sequence[TaskTerminal]) -> str | None:
    """Why CRIU could not restore this tree, in one line; None when it can. `tasks`: root
    first."""
    if not tasks or not led_outside(tasks):
        return None
    pids = {t.pid for t in tasks}
    root = tasks[0]
    sessions = sorted({t.session for t in tasks if t.session not in pids})
    if len(sessions) > 1:
        return (f"its tasks belong to {len(sessions)} sessions led outside it "
                f"({', '.join(map(str, sessions))}): CRIU restores a tree into one session")
    for task in tasks:
        if task.pgrp not in pids and task.pgrp != root.pgrp:
            return (f"task {task.pid} ({task.comm}) is in process group {task.pgrp}, led "
                    "outside the tree and not the group of its root: CRIU could not restore it")
    terminals = outside_terminals(tasks)
    if len(terminals) > 1:
        names = ", ".join(f"/dev/pts/{index}" for _, _, index in terminals)
        return (f"it holds {len(terminals)} terminals of sessions led outside it ({names}): "
                "CRIU restores one")
    return None


def shell_tty_of(tasks: Sequence[TaskTerminal]) -> ShellTty | None:
    """The terminal to give the restored job (None: it holds none, or it leads its session)."""
    if not led_outside(tasks):
        return None
    terminals = outside_terminals(tasks)
    if len(terminals) != 1:
        return None
    rdev, dev, index = terminals[0]
    return ShellTty(rdev, dev, index)


# -- the sensor ---------------------------------------------------------------------------------

def _stat_fields(text: str) -> tuple[str, int, int, int]:
    """(comm, pgrp, session, tty_nr) of a /proc/PID/stat line."""
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, int(fields[2]), int(fields[3]), int(fields[4])


def read_task(proc_root: Path, pid: int) -> TaskTerminal | None:
    base = proc_root / str(pid)
    try:
        comm, pgrp, session, tty_nr = _stat_fields((base / "stat").read_text(errors="replace"))
        names = os.listdir(base / "fd")
    except (OSError, ValueError, IndexError):
        return None
    slaves: list[tuple[int, int, int]] = []
    masters: list[int] = []
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(base / "fd" / name)
            index = pts_index(link)
            if index is not None:
                st = os.stat(base / "fd" / name)
                slaves.append((st.st_rdev, st.st_dev, index))
            elif link == "/dev/ptmx":
                master = fdinfo_tty_index((base / "fdinfo" / name).read_text())
                if master is not None:
                    masters.append(master)
    return TaskTerminal(pid, comm, session, pgrp, tty_nr, tuple(slaves), tuple(masters))


def read_tasks(proc_root: Path | str, pids: Iterable[int]) -> list[TaskTerminal]:
    root = Path(proc_root)
    return [task for pid in pids if (task := read_task(root, pid)) is not None]


def holder_serving(key: str, directory: Path, deadline: float = 1.0) -> str | None:
    """The socket of an oomguard holder in `directory` whose pty is `key` (a job restored
    from a shell prompt before: its terminal is a holder's). The directory is the user's:
    all of it is asked within `deadline` seconds (NOTIFY_DEADLINE at most per socket),
    however many sockets are there and however slowly they answer."""
    from oomguard.terminal.client import NOTIFY_DEADLINE, HolderError, request

    end = time.monotonic() + deadline
    with contextlib.suppress(OSError):
        for path in sorted(directory.glob("tty-*.sock")):
            left = end - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(HolderError):
                if request(path, "info", timeout=min(left, NOTIFY_DEADLINE)).get("key") == key:
                    return str(path)
    return None


def tell_terminal(tty: ShellTty, text: str) -> bool:
    """Write a line on the terminal the job was typed at (best effort: it may be gone, or be
    another terminal by now: its device number must still match)."""
    try:
        fd = os.open(tty.path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_rdev != tty.rdev:
            return False
        os.write(fd, f"\r\n{text}\r\n".encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


PTY_TYPE = 1  # TtyType.PTY in CRIU's tty-info image
PTS_MAJORS = range(136, 144)  # UNIX98_PTY_SLAVE_MAJOR .. + UNIX98_PTY_MAJOR_COUNT


def images_hold_shell_terminal(images: Path) -> bool:
    """Whether a checkpoint's images hold a pts slave of a session led outside the tree
    (one taken before oomguard recorded SHELL_TTY in meta.json): its restore needs a leader.
    From pstree.img (1: pid, 4: sid) and tty-info.img (2: type, 6: sid, 8: rdev)."""
    from oomguard.model.errors import StoreError
    from oomguard.store.pagemap import image_records

    try:
        pids = {record.get(1) for record in image_records(images / "pstree.img")}
        ttys = image_records(images / "tty-info.img") if (images / "tty-info.img").exists() \
            else []
    except StoreError:
        return False
    return any(record.get(2) == PTY_TYPE and record.get(6) and record.get(6) not in pids
               and os.major(record.get(8, 0)) in PTS_MAJORS for record in ttys)
