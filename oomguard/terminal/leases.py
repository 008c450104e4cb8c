"""Terminals for a restore: for each external terminal a checkpoint recorded, a slave fd from
its holder when that still lives, else a new pty with a new holder (owned by the job's user,
listening where the old one did when it can); CRIU gets each as `--inherit-fd`. A job typed
at a shell prompt (its terminal's session was led outside the tree) gets a new pty whose holder
leads the job's session and runs CRIU (oomguard/terminal/leader.py): `TtyLease.wrapper`."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.terminal.client import (
    LEADER_MODULE,
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
from oomguard.terminal.shelljob import SHELL_TTY


@dataclass
class LeaderLease:
    """A new pty and the socket its holder will serve, for a job typed at a shell prompt:
    the leader (a child of the runner) gets the three fds and runs CRIU."""

    master: int
    slave: int
    listener: socket.socket
    path: Path
    uid: int
    gid: int
    origin: str | None = None  # the key of the terminal it stands in for

    def fds(self) -> list[int]:
        return [self.master, self.slave, self.listener.fileno()]

    def argv(self, pidfile: Path) -> list[str]:
        argv = [sys.executable, "-I", "-m", LEADER_MODULE, "--master-fd", str(self.master),
                "--slave-fd", str(self.slave), "--listen-fd", str(self.listener.fileno()),
                "--uid", str(self.uid), "--gid", str(self.gid), "--pidfile", str(pidfile)]
        if self.origin:
            argv += ["--origin", self.origin]
        return [*argv, "--"]

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.listener.close()

    def abandon(self) -> None:
        """The restore failed: the leader (if it ran) has ended; its socket goes too."""
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def lease_leader(uid: int, gid: int, origin: str | None) -> LeaderLease:
    master, slave = os.openpty()
    for fd in (master, slave):
        os.set_inheritable(fd, True)
    try:
        path = new_socket_path(SYSTEM_DIR / str(uid))
        listener = listen_at(path, uid, gid)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    listener.set_inheritable(True)
    return LeaderLease(master, slave, listener, path, uid, gid, origin)


@dataclass
class TtyLease:
    fds: list[int] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)  # updated: where each is served
    new_holders: list[str] = field(default_factory=list)
    leader: LeaderLease | None = None  # a job typed at a shell prompt: CRIU runs under it

    def pass_fds(self) -> list[int]:
        return [*self.fds, *(self.leader.fds() if self.leader is not None else [])]

    def wrapper(self, pidfile: Path) -> list[str]:
        """What CRIU's command line is run under (the leader), if anything."""
        return self.leader.argv(pidfile) if self.leader is not None else []

    def shell_entry(self) -> dict[str, Any] | None:
        """meta.extra's record of the job's new terminal, after a restore under a leader."""
        if self.leader is None:
            return None
        return {"key": self.leader.origin, "socket": str(self.leader.path)}

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []

    def succeeded(self) -> None:
        self.close_fds()
        if self.leader is not None:
            self.leader.close()  # the leader has its own copies
        for entry in self.entries:
            notify(entry.get("socket"), "unpin")

    def failed(self) -> None:
        """The old holders stay as they were (pinned to the checkpoint); new ones end."""
        self.close_fds()
        if self.leader is not None:
            self.leader.abandon()
        for path in self.new_holders:
            notify(path, "done", force=True)


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
        shell = extra.get(SHELL_TTY)
        if isinstance(shell, dict):
            origin = shell.get("key")
            lease.leader = lease_leader(uid, gid, origin if isinstance(origin, str) else None)
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


def wants_shell_terminal(criu_error: str) -> bool:
    """CRIU needs a terminal to give the job (a job typed at a shell prompt, checkpointed
    before oomguard recorded its terminal): restored under a leader, it gets a new one."""
    return "tty to inherit session" in criu_error


def job_ended(extra: dict[str, Any], uid: int, status: int | None, sig: int | None) -> None:
    """A restored job's root exited (the daemon saw it): its terminal's holder tells the
    people attached how, and ends (a holder whose job is being dumped ignores it)."""
    sockets = [entry.get("socket") for entry in extra.get(TTYS) or []]
    shell = extra.get(SHELL_TTY)
    if isinstance(shell, dict):
        sockets.append(shell.get("socket"))
    fields: dict[str, int] = {}
    if sig is not None:
        fields["signal"] = sig
    elif status is not None:
        fields["status"] = status
    for path in {s for s in sockets if isinstance(s, str) and s}:
        if trusted_socket(path, uid):
            notify(path, "done", **fields)
