"""The pty holder of a job with a terminal (dtach-style): owns the pty's master outside the
job's process tree, keeps a scrollback, serves `oomguard attach` clients on a UNIX socket, and
hands a slave fd to a restorer (SCM_RIGHTS) so CRIU can give the restored job its terminal back.

Run as a script (`python -I holder.py --master-fd N --listen-fd N ...`): stdlib only. It
leaves its session at once (setsid, SIGHUP ignored), so closing the terminal that started the
job does not end it. Requests are one JSON line; see oomguard/terminal/client.py for the client side.
After an `attach` request the client sends frames (1 byte kind, 4 bytes length, payload): `d`
input for the job, `w` a window size (rows, cols as two u16); the holder sends raw output.

States: the job holds the slave (output is relayed). When every slave is closed (the job exited
or was checkpointed) the holder opens a slave itself (TIOCGPTPEER) and waits `--grace` seconds
for a `pin` (a checkpoint names it); pinned, it waits for a restorer; `unpin` after a restore
lets go of its own slave. `done` (the job's exit seen by `oomguard exec`) or the grace running
out with nothing pinned ends it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import termios
import time
from typing import Any

TIOCGPTPEER = 0x5441
SCROLLBACK = 64 * 1024
FRAME = struct.Struct(">cI")


class Holder:
    def __init__(self, master: int, listener: socket.socket, grace: float,
                 pinned: str | None, origin: list[str]) -> None:
        self.master = master
        self.listener = listener
        self.grace = grace
        self.pinned = pinned
        self.origin = origin  # keys of the terminal(s) this pty stands in for (after a restore)
        self.own_slave: int | None = None
        self.vacant_since: float | None = None
        self.scrollback = b""
        self.clients: dict[socket.socket, bytes] = {}  # attached client -> unparsed input
        self.sel = selectors.DefaultSelector()
        self.finished = False
        os.set_blocking(master, False)
        slave = self._open_slave()
        st = os.fstat(slave)
        os.close(slave)
        self.key = f"tty[{st.st_rdev:x}:{st.st_dev:x}]"
        self.sel.register(master, selectors.EVENT_READ, "master")
        self.sel.register(listener, selectors.EVENT_READ, "listen")

    def _open_slave(self) -> int:
        return int(fcntl.ioctl(self.master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY))

    # -- output --------------------------------------------------------------------------------

    def broadcast(self, data: bytes) -> None:
        self.scrollback = (self.scrollback + data)[-SCROLLBACK:]
        for client in list(self.clients):
            try:
                client.sendall(data)
            except OSError:
                self.drop(client)

    def note(self, text: str) -> None:
        self.broadcast(f"\r\n[oomguard: {text}]\r\n".encode())

    def read_master(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            data = b""
        if data:
            self.broadcast(data)
            return
        # Every slave is closed: the job ended or was checkpointed. Hold one ourselves.
        self.own_slave = self._open_slave()
        self.vacant_since = time.monotonic()

    # -- clients -------------------------------------------------------------------------------

    def drop(self, client: socket.socket) -> None:
        self.clients.pop(client, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(client)
        client.close()

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(2.0)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid not in (0, os.getuid()):
            conn.close()
            return
        try:
            line = b""
            while not line.endswith(b"\n") and len(line) < 4096:
                chunk = conn.recv(1)
                if not chunk:
                    break
                line += chunk
            request = json.loads(line or b"{}")
            self.handle(conn, request)
        except (OSError, ValueError):
            conn.close()

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "key": self.key, "origin": self.origin,
                "pinned": self.pinned, "vacant": self.own_slave is not None}

    def handle(self, conn: socket.socket, request: dict[str, Any]) -> None:
        op = request.get("op")
        if op == "attach":
            conn.sendall(json.dumps(self.info()).encode() + b"\n" + self.scrollback)
            if self.pinned:
                conn.sendall(f"\r\n[oomguard: checkpointed as {self.pinned}]\r\n".encode())
            self.clients[conn] = b""
            self.sel.register(conn, selectors.EVENT_READ, "client")
            return
        if op == "slave":
            slave = self._open_slave()
            try:
                socket.send_fds(conn, [json.dumps(self.info()).encode() + b"\n"], [slave])
            finally:
                os.close(slave)
        elif op == "pin":
            self.pinned = str(request.get("id") or "?")
            self.note(f"job checkpointed as {self.pinned}; `oomguard restore {self.pinned}` "
                      "brings it back")
            conn.sendall(b"{}\n")
        elif op == "unpin":
            self.pinned = None
            if self.own_slave is not None:
                os.close(self.own_slave)
                self.own_slave = None
                self.vacant_since = None
            self.note("job restored")
            conn.sendall(b"{}\n")
        elif op == "done":
            conn.sendall(b"{}\n")
            self.finish()
        else:
            conn.sendall(json.dumps(self.info()).encode() + b"\n")
        conn.close()

    def client_input(self, client: socket.socket) -> None:
        try:
            data = client.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.drop(client)
            return
        buf = self.clients[client] + data
        while len(buf) >= FRAME.size:
            kind, length = FRAME.unpack_from(buf)
            if len(buf) < FRAME.size + length:
                break
            payload = buf[FRAME.size:FRAME.size + length]
            buf = buf[FRAME.size + length:]
            if kind == b"d":
                with contextlib.suppress(OSError):
                    os.write(self.master, payload)
            elif kind == b"w" and length == 4:
                rows, cols = struct.unpack(">HH", payload)
                with contextlib.suppress(OSError):
                    fcntl.ioctl(self.master, termios.TIOCSWINSZ,
                                struct.pack("HHHH", rows, cols, 0, 0))
        self.clients[client] = buf

    # -- the loop ------------------------------------------------------------------------------

    def finish(self) -> None:
        """Pass on what the job wrote last, then end: clients see EOF."""
        with contextlib.suppress(OSError):
            while data := os.read(self.master, 65536):
                self.broadcast(data)
        self.finished = True

    def run(self) -> None:
        while not self.finished:
            if (self.vacant_since is not None and self.pinned is None
                    and time.monotonic() - self.vacant_since > self.grace):
                return
            for key, _ in self.sel.select(timeout=0.5):
                if key.data == "master":
                    self.read_master()
                elif key.data == "listen":
                    self.accept()
                else:
                    self.client_input(key.fileobj)  # type: ignore[arg-type]
                if self.finished:
                    return


def main(argv: list[str]) -> int:
    opts: dict[str, str] = {}
    origin: list[str] = []
    while argv:
        name = argv.pop(0)
        value = argv.pop(0)
        if name == "--origin":
            origin.append(value)
        else:
            opts[name] = value
    if os.fork():  # the caller does not wait for us (and a daemon gets no zombie)
        os._exit(0)
    os.setsid()
    os.chdir("/")  # hold no mount busy
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    listener = socket.socket(fileno=int(opts["--listen-fd"]))
    path = listener.getsockname()
    inode = os.stat(path).st_ino if isinstance(path, str) and path else None
    holder = Holder(int(opts["--master-fd"]), listener, float(opts.get("--grace", "30")),
                    opts.get("--pinned"), origin)
    try:
        holder.run()
    finally:
        with contextlib.suppress(OSError):
            if inode is not None and os.stat(path).st_ino == inode:
                os.unlink(path)  # still ours (a restorer may have bound a new holder there)
        for client in list(holder.clients):
            holder.drop(client)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
