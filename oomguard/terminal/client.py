"""Talking to pty holders (oomguard/terminal/holder.py): where their sockets live, starting one,
and its one-line JSON requests (info, pin, unpin, done, slave: a slave fd by SCM_RIGHTS)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomguard.model.errors import OomguardError

HOLDER_MODULE = "oomguard.terminal.holder"
LEADER_MODULE = "oomguard.terminal.leader"
SYSTEM_DIR = Path("/run/oomguard/tty")
SOCKET_NAME = re.compile(r"tty-[0-9a-f]{8}\.sock")
DEFAULT_GRACE = 30.0  # seconds a vacated terminal waits for a checkpoint to claim it
# What the daemon gives one holder (a socket the job's user chose) to take a notification and
# answer, all told: connect, send, the answer. A holder answers in milliseconds.
NOTIFY_DEADLINE = 0.5
MAX_LINE = 1 << 16  # a holder's one-line answer (its info) is far smaller


class HolderError(OomguardError):
    """No pty holder answers (gone, or not ours)."""


def runtime_dir(uid: int, environ: dict[str, str] | None = None,
                system_dir: Path = SYSTEM_DIR) -> Path:
    """$XDG_RUNTIME_DIR/oomguard for the user's own jobs when set, else /run/oomguard/tty/UID."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and uid == os.getuid():
        return Path(xdg) / "oomguard"
    return system_dir / str(uid)


def new_socket_path(directory: Path) -> Path:
    return directory / f"tty-{secrets.token_hex(4)}.sock"


def trusted_socket(path: str | Path, uid: int) -> bool:
    """Whether `path` (named by a job's environment: the job's user chose it) may be talked to
    by root on that user's behalf: a holder's socket name, a socket, owned by the user."""
    path = Path(path)
    if not SOCKET_NAME.fullmatch(path.name):
        return False
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid in (uid, os.geteuid())


def answers(path: Path | str) -> bool:
    """Whether something listens there (a dead holder's socket refuses connections)."""
    try:
        with _connect(path, 1.0) as sock:
            sock.sendall(b'{"op": "info"}\n')  # a holder is not kept waiting for a request
    except (HolderError, OSError):
        return False
    return True


def listen_at(path: Path, uid: int, gid: int) -> socket.socket:
    """A listening socket at `path` (its directory made 0700 and owned by uid), replacing a
    stale socket file there but never a live holder."""
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.geteuid() == 0 and directory.parent == SYSTEM_DIR:
            os.lchown(directory, uid, gid)
    except OSError as exc:
        raise HolderError(f"cannot make {directory} for the job's terminal ({exc.strerror}); "
                          "set XDG_RUNTIME_DIR to a directory of yours") from exc
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise HolderError(f"{path} exists and is not a socket")
        if answers(path):
            raise HolderError(f"a terminal holder already listens on {path}")
        path.unlink()  # a dead holder's socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))  # in a 0700 directory: its mode does not matter
        if os.geteuid() == 0:
            os.lchown(path, uid, gid)
        sock.listen(8)
    except OSError:
        sock.close()
        raise
    return sock


def spawn_holder(master: int, listener: socket.socket, *, grace: float = DEFAULT_GRACE,
                 pinned: str | None = None, origin: Sequence[str] = (),
                 uid: int | None = None, gid: int | None = None) -> None:
    """Start a holder for `master`, serving `listener`; it detaches at once. As `uid` when given
    (a restore run by root for a user's job: the user attaches to it)."""
    # -I: isolated (no environment, no user site, no current directory on the path: a holder
    # started from a directory someone else controls imports nothing from there).
    argv = [sys.executable, "-I", "-m", HOLDER_MODULE, "--master-fd", str(master),
            "--listen-fd", str(listener.fileno()), "--grace", str(grace)]
    if pinned:
        argv += ["--pinned", pinned]
    for key in origin:
        argv += ["--origin", key]
    as_user: dict[str, Any] = {}
    if uid is not None and uid != os.geteuid():
        as_user = {"user": uid, "group": gid, "extra_groups": []}
    proc = subprocess.Popen(argv, pass_fds=(master, listener.fileno()), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, **as_user)
    if proc.wait(timeout=30) != 0:
        raise HolderError(f"the terminal holder did not start (status {proc.returncode})")


def _connect(path: Path | str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise HolderError(f"no terminal holder answers on {path}: {exc.strerror}") from exc
    return sock


def _read_line(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """One JSON line, read a byte at a time (what follows it is not ours to take); all of it
    by `deadline` (time.monotonic()) when given, else each byte within the socket's timeout."""
    line = b""
    while not line.endswith(b"\n") and len(line) < MAX_LINE:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HolderError("the terminal holder did not answer in time")
            sock.settimeout(left)
        chunk = sock.recv(1)
        if not chunk:
            break
        line += chunk
    try:
        answer = json.loads(line) if line else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise HolderError("the terminal holder gave no answer")
    return answer


def request(path: Path | str, op: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
    """One request and its answer, all within `timeout` seconds (a socket that accepts and
    then trickles its answer is given up on at the deadline, as one that never answers)."""
    deadline = time.monotonic() + timeout
    with _connect(path, timeout) as sock:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
            return _read_line(sock, deadline)
        except TimeoutError as exc:  # the deadline ran out inside a recv or send
            raise HolderError(f"the terminal holder on {path} did not answer in time") from exc
        except OSError as exc:
            raise HolderError(f"terminal holder on {path}: {exc}") from exc


def request_slave(path: Path | str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """A slave fd of the holder's pty (the caller closes it) and the holder's info."""
    with _connect(path, timeout) as sock:
        try:
            sock.sendall(b'{"op": "slave"}\n')
            data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        except OSError as exc:
            raise HolderError(f"terminal holder on {path}: {exc}") from exc
    if not fds:
        raise HolderError(f"the terminal holder on {path} sent no terminal")
    try:
        info = json.loads(data)
    except ValueError:
        info = {}
    return fds[0], info if isinstance(info, dict) else {}


def connect_attach(path: Path | str) -> tuple[socket.socket, dict[str, Any]]:
    """An attached connection (the holder's info read off it; frames follow where the
    holder's info says "frames", else its raw output)."""
    sock = _connect(path, 5.0)
    try:
        sock.sendall(b'{"op": "attach", "frames": true}\n')
        info = _read_line(sock, time.monotonic() + 5.0)
    except (OSError, HolderError) as exc:
        sock.close()
        raise HolderError(f"terminal holder on {path}: {exc}") from exc
    sock.settimeout(None)
    return sock, info


def notify(path: str | None, op: str, deadline: float = NOTIFY_DEADLINE, **fields: Any) -> bool:
    """Best effort (dumping/pin/unpin/done), within `deadline` seconds in all: whether the
    holder answered."""
    if not path:
        return False
    with contextlib.suppress(HolderError):
        request(path, op, timeout=deadline, **fields)
        return True
    return False


def notify_all(paths: Sequence[str], op: str, deadline: float = NOTIFY_DEADLINE,
               **fields: Any) -> list[str]:
    """notify() each holder at once (one thread each): the ones that answered, within about
    `deadline` seconds however many there are and however slowly they answer."""
    answered: list[str] = []
    if len(paths) == 1:
        return list(paths) if notify(paths[0], op, deadline, **fields) else []

    def one(path: str) -> None:
        if notify(path, op, deadline, **fields):
            answered.append(path)

    threads = [threading.Thread(target=one, args=(path,), daemon=True) for path in paths]
    end = time.monotonic() + deadline
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(end - time.monotonic(), 0.0) + 0.1)
    return [path for path in paths if path in answered]
