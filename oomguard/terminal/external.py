"""Terminals a process tree uses whose other end lives outside it (a sensor), and the CRIU
arguments that hand such a terminal over: `--external tty[RDEV:DEV]` at dump,
`--inherit-fd fd[N]:tty[RDEV:DEV]` at restore (CRIU's own key format, criu/tty.c: both numbers
in lower-case hex, no 0x; RDEV is the terminal's st_rdev, DEV the st_dev of its devpts)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TTYS = "ttys"  # meta.extra key: [{"key": "tty[RDEV:DEV]", "index": N, "socket": PATH}]
SOCKET_ENV = "OOMGUARD_TTY_SOCKET"  # set by `oomguard exec` for the job: where its holder listens
_PTS_LINK = re.compile(r"^/dev/pts/(\d+)$")
_KEY = re.compile(r"^tty\[([0-9a-f]+):([0-9a-f]+)\]$")
_TTY_INDEX = re.compile(r"^tty-index:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ExternalTty:
    """A pseudo-terminal slave the tree holds while its master is held outside the tree."""

    rdev: int
    dev: int
    index: int
    socket: str | None = None  # the holder's socket when the tree names one (oomguard exec)

    @property
    def key(self) -> str:
        return format_key(self.rdev, self.dev)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "index": self.index, "socket": self.socket}


def format_key(rdev: int, dev: int) -> str:
    return f"tty[{rdev:x}:{dev:x}]"


def parse_key(key: str) -> tuple[int, int]:
    """'tty[8800:1a]' -> (0x8800, 0x1a). Raises ValueError on anything else."""
    match = _KEY.match(key)
    if match is None:
        raise ValueError(f"not a CRIU tty key: {key!r}")
    return int(match.group(1), 16), int(match.group(2), 16)


def pts_index(link: str) -> int | None:
    """The index of a /dev/pts/N link target (an fd's readlink), else None."""
    match = _PTS_LINK.match(link)
    return int(match.group(1)) if match else None


def fdinfo_tty_index(text: str) -> int | None:
    """The pty index a /dev/ptmx fd is the master of (its fdinfo's `tty-index:` line)."""
    match = _TTY_INDEX.search(text)
    return int(match.group(1)) if match else None


def environ_value(raw: bytes, name: str) -> str | None:
    """One variable of a /proc/PID/environ (NUL-separated NAME=value)."""
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def dump_args(ttys: Iterable[ExternalTty]) -> list[str]:
    args: list[str] = []
    for tty in ttys:
        args += ["--external", tty.key]
    return args


def inherit_args(fds: Iterable[tuple[int, str]]) -> list[str]:
    """[(fd, key)] -> --inherit-fd fd[N]:KEY for each."""
    args: list[str] = []
    for fd, key in fds:
        parse_key(key)
        args += ["--inherit-fd", f"fd[{fd}]:{key}"]
    return args


@dataclass(frozen=True)
class FdEntry:
    """One open fd of a process: its link target, and for a pts slave its st_rdev/st_dev, for
    a ptmx master the index from its fdinfo."""

    link: str
    rdev: int = 0
    dev: int = 0
    master_index: int | None = None


def stat_session_tty(text: str) -> tuple[int, int]:
    """(session, tty_nr) from a /proc/PID/stat line (the command may hold spaces and ')')."""
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[3]), int(fields[4])


def external_from(entries: Iterable[FdEntry], controlled: Iterable[int],
                  socket: str | None = None) -> list[ExternalTty]:
    """Every pts slave the tree holds whose master no process of the tree holds (a master
    inside the tree is CRIU's ordinary case) and that is the controlling terminal of a session
    led inside the tree (`controlled`: their st_rdev, i.e. the leaders' tty_nr). CRIU restores
    such a terminal from an inherited fd and the session with it; a terminal of a session led
    outside the tree (a job started from an interactive shell) it cannot: that is left to
    CRIU's --shell-job handling, as before."""
    owned = set(controlled)
    slaves: dict[int, tuple[int, int]] = {}
    masters: set[int] = set()
    for entry in entries:
        index = pts_index(entry.link)
        if index is not None:
            slaves.setdefault(index, (entry.rdev, entry.dev))
        elif entry.master_index is not None:
            masters.add(entry.master_index)
    return [ExternalTty(rdev, dev, index, socket)
            for index, (rdev, dev) in sorted(slaves.items())
            if index not in masters and rdev in owned]


class TtySensor:
    """Reads the fd tables of a tree's processes from /proc (root injectable for tests)."""

    def __init__(self, proc_root: Path | str = "/proc") -> None:
        self.root = Path(proc_root)

    def fd_entries(self, pid: int) -> list[FdEntry]:
        base = self.root / str(pid)
        found = []
        try:
            names = os.listdir(base / "fd")
        except OSError:
            return []
        for name in names:
            with contextlib.suppress(OSError):
                link = os.readlink(base / "fd" / name)
                if pts_index(link) is not None:
                    st = os.stat(base / "fd" / name)
                    found.append(FdEntry(link, st.st_rdev, st.st_dev))
                elif link == "/dev/ptmx":
                    index = fdinfo_tty_index((base / "fdinfo" / name).read_text())
                    found.append(FdEntry(link, master_index=index))
        return found

    def socket_named(self, pids: Iterable[int]) -> str | None:
        for pid in pids:
            with contextlib.suppress(OSError):
                value = environ_value((self.root / str(pid) / "environ").read_bytes(),
                                      SOCKET_ENV)
                if value:
                    return value
        return None

    def controlled(self, pids: Iterable[int]) -> list[int]:
        """The controlling terminals (tty_nr) of the session leaders among `pids`."""
        found = []
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                session, tty_nr = stat_session_tty((self.root / str(pid) / "stat").read_text())
                if session == pid and tty_nr:
                    found.append(tty_nr)
        return found

    def external_ttys(self, pids: Iterable[int]) -> list[ExternalTty]:
        pids = list(pids)
        ttys = external_from([e for pid in pids for e in self.fd_entries(pid)],
                             self.controlled(pids))
        if not ttys:
            return []
        socket = self.socket_named(pids)
        return [ExternalTty(t.rdev, t.dev, t.index, socket) for t in ttys]


def external_ttys(proc_root: Path | str, pids: Iterable[int]) -> list[ExternalTty]:
    """TtySensor(proc_root).external_ttys(pids), never raising: a tree without readable fds
    simply has none (CRIU then says what it cannot dump)."""
    try:
        return TtySensor(proc_root).external_ttys(pids)
    except OSError:
        return []
