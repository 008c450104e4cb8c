"""Terminals for a restore: for each external terminal a checkpoint recorded, a slave fd from
its holder when that still lives, else a new pty with a new holder (owned by the job's user,
listening where the old one did when it can); CRIU gets each as `--inherit-fd`."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.terminal.client import (
    SOCKET_NAME,
    SYSTEM_DIR,
    HolderError,
    listen_at,
    new_socket_path,
    notify,
    request_slave,
    spawn_holder,
    trusted_socket,
)
from oomguard.terminal.external import TTYS, inherit_args, parse_key


@dataclass
class TtyLease:
    fds: list[int] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)  # updated: where each is served
    new_holders: list[str] = field(default_factory=list)

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []

    def succeeded(self) -> None:
        self.close_fds()
        for entry in self.entries:
            notify(entry.get("socket"), "unpin")

    def failed(self) -> None:
        """The old holders stay as they were (pinned to the checkpoint); new ones end."""
        self.close_fds()
        for path in self.new_holders:
            notify(path, "done")


def _replacement_path(recorded: str | None, uid: int) -> Path:
    """Where a new holder listens: where the old one did (the job's environment names it)
    when that is in the user's directory under /run/oomguard/tty, or anywhere for root's own
    jobs; else a new name there (`oomguard attach PID` finds it)."""
    own_dir = SYSTEM_DIR / str(uid)
    if recorded and SOCKET_NAME.fullmatch(Path(recorded).name):
        path = Path(recorded)
        if path.parent == own_dir or (uid == os.geteuid() and path.parent.is_dir()):
            return path
    return new_socket_path(own_dir)


def _new_holder(entry: dict[str, Any], checkpoint_id: str, uid: int, gid: int,
                lease: TtyLease) -> int:
    master, slave = os.openpty()
    try:
        path = _replacement_path(entry.get("socket"), uid)
        try:
            listener = listen_at(path, uid, gid)
        except HolderError:  # a live holder of some other terminal is there
            path = new_socket_path(SYSTEM_DIR / str(uid))
            listener = listen_at(path, uid, gid)
        with listener:
            spawn_holder(master, listener, pinned=checkpoint_id, origin=[entry["key"]],
                         uid=uid, gid=gid)
    except BaseException:
        os.close(slave)
        raise
    finally:
        os.close(master)
    lease.new_holders.append(str(path))
    entry["socket"] = str(path)
    return slave


def lease_ttys(extra: dict[str, Any], checkpoint_id: str, uid: int, gid: int) -> TtyLease:
    """Raises HolderError or OSError (with the lease's fds closed) when a terminal cannot be
    had; ValueError for a malformed record."""
    lease = TtyLease()
    try:
        for recorded in extra.get(TTYS) or []:
            entry = dict(recorded)
            parse_key(entry["key"])
            fd: int | None = None
            if entry.get("socket") and trusted_socket(entry["socket"], uid):
                with contextlib.suppress(HolderError):
                    fd, info = request_slave(entry["socket"])
                    if entry["key"] not in (info.get("key"), *(info.get("origin") or [])):
                        os.close(fd)  # that holder serves another terminal now
                        fd = None
            if fd is None:
                fd = _new_holder(entry, checkpoint_id, uid, gid, lease)
            lease.fds.append(fd)
            lease.entries.append(entry)
        lease.args = inherit_args(zip(lease.fds, (e["key"] for e in lease.entries),
                                      strict=True))
    except BaseException:
        lease.failed()
        raise
    return lease


def gid_of(uid: int) -> int:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid


def criu_tty_hint(criu_error: str) -> str | None:
    """One line saying why CRIU could not give a job its terminal back, when that is it."""
    if "tty to inherit session" in criu_error or "No task found with sid" in criu_error:
        return ("the job's terminal belongs to a session led outside the checkpointed tree (a "
                "job started from an interactive shell): CRIU restores it only under that same "
                "terminal session, which is gone; jobs started with `oomguard exec` on a "
                "terminal restore anywhere")
    return None
