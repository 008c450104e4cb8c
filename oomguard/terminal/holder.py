"""The pty holder of a job with a terminal (dtach-style): owns the pty's master outside the
job's process tree, keeps a scrollback, serves `oomguard attach` clients on a UNIX socket, and
hands a slave fd to a restorer (SCM_RIGHTS) so CRIU can give the restored job its terminal back.

Run as `python -I -m oomguard.terminal.holder --master-fd N --listen-fd N ...` (stdlib and
oomguard.terminal's wire, jobprocs and holderprocess only). It leaves its session at once
(setsid, SIGHUP ignored), so closing the terminal that started the job does not end it.
Requests are one JSON line (see oomguard/terminal/client.py); an `attach` is followed by frames
(oomguard/terminal/wire.py).

The job's state comes from the pty itself: the master is in packet mode, and the session's
leader (the namespace's init of `oomguard exec`) stops and restarts the terminal's output after
each job-control change (the job took the foreground to read, stopped, went on), which the
master reports as status bytes (TIOCPKT_STOP/START; the keys Ctrl-C, Ctrl-Z, Ctrl-S report
too); the holder then reads the foreground process group and the job's state and tells its
clients. (After a restore of a job typed at a shell prompt the holder is that leader itself:
oomguard/terminal/leader.py.)

Vacancy: when every slave is closed (the job exited or was checkpointed) the holder opens a
slave itself (TIOCGPTPEER). Pinned by a checkpoint (`pin`), it waits for a restorer; told a
dump is under way (`dumping`), it waits `--grace` seconds for the pin; otherwise the job is
over: it waits a moment for `done` (with the exit status, from `oomguard exec` or the daemon)
and ends, telling its clients.
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
from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.terminal.holderprocess import Leader, detach_stdio, parse_options, serve
from oomguard.terminal.jobprocs import (
    descendants,
    first_child_pgrp,
    foreground_of,
    proc_state,
    session_of,
    waiting_in_poll,
)
from oomguard.terminal.wire import (
    CONTROL,
    INPUT,
    OUTPUT,
    STATE,
    WINDOW,
    FrameReader,
    JobState,
    frame,
    json_frame,
)

TIOCGPTPEER = 0x5441
SCROLLBACK = 64 * 1024
LINGER = 1.5  # a vacated, unpinned terminal waits this long for `done` and its status


@dataclass
class Client:
    framed: bool
    reader: FrameReader = field(default_factory=FrameReader)


class Holder:
    def __init__(self, master: int, listener: socket.socket, grace: float,
                 pinned: str | None, origin: list[str], leader: Leader | None = None) -> None:
        self.master = master
        self.listener = listener
        self.grace = grace
        self.origin = origin  # keys of the terminal(s) this pty stands in for (after a restore)
        self.leader = leader
        self.state = JobState(pinned=pinned)
        self.own_slave: int | None = None
        self.vacant_since: float | None = None
        self.scrollback = b""
        self.clients: dict[socket.socket, Client] = {}
        self.sel = selectors.DefaultSelector()
        self.finished = False
        os.set_blocking(master, False)
        with contextlib.suppress(OSError):  # job-control changes reach us as status bytes
            fcntl.ioctl(master, termios.TIOCPKT, struct.pack("i", 1))
        slave = self._open_slave()
        st = os.fstat(slave)
        os.close(slave)
        self.key = f"tty[{st.st_rdev:x}:{st.st_dev:x}]"
        self.sel.register(master, selectors.EVENT_READ, "master")
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        if leader is not None:
            self.sel.register(leader.wake_fd(), selectors.EVENT_READ, "leader")

    def _open_slave(self) -> int:
        return int(fcntl.ioctl(self.master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY))

    # -- the job's state -----------------------------------------------------------------------

    def job_pgrp(self) -> int | None:
        """The job's process group: the terminal's foreground when the job has it, else the
        first child of the session's leader (an init's job), or what the leader knows."""
        if self.leader is not None:
            return self.leader.job_pgrp()
        sid, fg = session_of(self.master), foreground_of(self.master)
        if sid is None:
            return None
        if fg is not None and fg != sid:
            return fg
        return first_child_pgrp(sid)

    def observe(self, stop_told: bool = False) -> None:
        """Read the job's state off the pty and /proc; tell the clients when it changed. A
        stopped job counts as stopped by job control only when the session's leader said so
        (`stop_told`: it flushes the terminal's input for job-control changes alone): a job
        oomguard freezes for a checkpoint is stopped too, and no client should act on that."""
        if self.state.ended:
            return
        sid, fg = session_of(self.master), foreground_of(self.master)
        has_terminal = sid is not None and fg is not None and fg != sid
        pgrp = self.job_pgrp()
        in_t = pgrp is not None and proc_state(pgrp) == "T"
        stopped = in_t and (stop_told or self.state.stopped)
        self.set_state(replace(self.state, terminal=has_terminal and not stopped,
                               stopped=stopped))

    def set_state(self, state: JobState) -> None:
        if state == self.state:
            return
        self.state = state
        for client, info in list(self.clients.items()):
            if info.framed:
                self.send(client, json_frame(STATE, state.as_dict()))

    def end(self, status: int | None = None, sig: int | None = None) -> None:
        """The job is over: clients are told (with its status where known), then EOF."""
        self.drain_master()
        if not self.state.ended:
            self.set_state(replace(self.state, ended=True, terminal=False, stopped=False,
                                   status=status if status is not None else self.state.status,
                                   signal=sig if sig is not None else self.state.signal))
        self.finished = True

    def job_control(self, op: str, sig: int | None = None) -> None:
        """`cont` (as fg), `stop` (as Ctrl-Z), `signal`, or `want` (the user typed a line for
        a job that never read its terminal: if it waits in select(2), poll(2) or epoll, which
        do not stop a job in the background as a read does, it gets the terminal as if it had
        read it; otherwise the line stays for the user's shell): to the job's process group."""
        pgrp = self.job_pgrp()
        if pgrp is None:
            return
        if op == "want":
            leader = os.getpid() if self.leader is not None else session_of(self.master)
            if self.state.terminal or leader is None \
                    or not waiting_in_poll(descendants(leader)):
                return  # it does not wait for input: the line stays for the user's shell
            if self.leader is not None:
                self.leader.give_terminal(pgrp)
                self.observe()
                return
            sig = signal.SIGTTIN  # its init hands it the terminal, as for a read
        number = {"cont": signal.SIGCONT, "stop": signal.SIGTSTP}.get(op, sig)
        if number is None:
            return
        with contextlib.suppress(OSError):
            os.killpg(pgrp, number)
        # The session's leader sees the group stop or go on, and says so (a status byte).

    # -- output --------------------------------------------------------------------------------

    def send(self, client: socket.socket, data: bytes) -> None:
        try:
            client.sendall(data)
        except OSError:
            self.drop(client)

    def broadcast(self, data: bytes) -> None:
        self.scrollback = (self.scrollback + data)[-SCROLLBACK:]
        for client, info in list(self.clients.items()):
            self.send(client, frame(OUTPUT, data) if info.framed else data)

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
        if len(data) > 1 or data == b"\0":
            self.broadcast(data[1:])  # packet mode: a 0 byte, then the job's output
            return
        if data:  # a status byte: the session's leader announced a job-control change
            self.observe(stop_told=True)
            return
        self.vacate()

    def drain_master(self) -> None:
        with contextlib.suppress(OSError):
            while data := os.read(self.master, 65536):
                if len(data) > 1:
                    self.broadcast(data[1:])

    def vacate(self) -> None:
        """Every slave is closed: the job ended or was checkpointed. Hold one ourselves."""
        if self.own_slave is None:
            self.own_slave = self._open_slave()
        if self.vacant_since is None:
            self.vacant_since = time.monotonic()

    def vacancy_over(self) -> bool:
        """Whether the job is over for this terminal. As the job's leader: once every child
        is reaped (after a dump under way, once pinned or after the grace: a restore gives
        the job a new terminal). Otherwise once every slave is closed: never while pinned,
        after the grace while a dump is under way, else after a moment for its status."""
        if self.leader is not None:
            if self.leader.alive():
                return False
            if self.state.dumping and not self.state.pinned:
                return self._waited() > self.grace
            return True
        if self.vacant_since is None or self.state.pinned:
            return False
        return self._waited() > (self.grace if self.state.dumping else LINGER)

    def _waited(self) -> float:
        if self.vacant_since is None:
            self.vacant_since = time.monotonic()
        return time.monotonic() - self.vacant_since

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
            self.handle(conn, request if isinstance(request, dict) else {})
        except (OSError, ValueError):
            conn.close()

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "key": self.key, "origin": self.origin,
                "pinned": self.state.pinned, "vacant": self.own_slave is not None,
                "frames": True, "state": self.state.as_dict()}

    def handle(self, conn: socket.socket, request: dict[str, Any]) -> None:
        op = request.get("op")
        if op == "attach":
            framed = request.get("frames") is True
            self.observe()
            conn.sendall(json.dumps(self.info()).encode() + b"\n")
            if framed:
                conn.sendall(frame(OUTPUT, self.scrollback)
                             + json_frame(STATE, self.state.as_dict()))
            else:
                conn.sendall(self.scrollback)
                if self.state.pinned:
                    conn.sendall(f"\r\n[oomguard: checkpointed as {self.state.pinned}]\r\n"
                                 .encode())
            self.clients[conn] = Client(framed)
            self.sel.register(conn, selectors.EVENT_READ, "client")
            return
        if op == "slave":
            slave = self._open_slave()
            try:
                socket.send_fds(conn, [json.dumps(self.info()).encode() + b"\n"], [slave])
            finally:
                os.close(slave)
        elif op in ("pin", "dumping"):
            checkpoint_id = str(request.get("id") or "?")
            if op == "pin":
                self.set_state(replace(self.state, pinned=checkpoint_id, dumping=None))
                self.note(f"job checkpointed as {checkpoint_id}; `oomguard restore "
                          f"{checkpoint_id}` brings it back")
            else:
                self.set_state(replace(self.state, dumping=checkpoint_id))
            conn.sendall(b"{}\n")
        elif op == "unpin":  # restored (or its dump failed): the job runs on this terminal
            self.set_state(replace(self.state, pinned=None, dumping=None))
            if self.own_slave is not None:
                os.close(self.own_slave)
                self.own_slave = None
                self.vacant_since = None
            if request.get("restored", True):
                self.note("job restored")
            conn.sendall(b"{}\n")
        elif op == "done":
            conn.sendall(b"{}\n")
            # As the job's leader we see its end ourselves: a root that exits may leave
            # processes of the job running (a daemon it started), and they keep the terminal.
            busy = self.leader is not None and self.leader.alive()
            if not (self.state.pinned or self.state.dumping or busy) or request.get("force"):
                status, sig = request.get("status"), request.get("signal")
                self.end(status if isinstance(status, int) else None,
                         sig if isinstance(sig, int) else None)
        elif op in ("cont", "stop", "signal", "want"):
            sig = request.get("signal")
            self.job_control(op, sig if isinstance(sig, int) else None)
            conn.sendall(json.dumps({"state": self.state.as_dict()}).encode() + b"\n")
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
        try:
            frames = self.clients[client].reader.feed(data)
        except ValueError:
            self.drop(client)
            return
        for kind, payload in frames:
            if kind == INPUT:
                with contextlib.suppress(OSError):
                    os.write(self.master, payload)
            elif kind == WINDOW and len(payload) == 4:
                rows, cols = struct.unpack(">HH", payload)
                with contextlib.suppress(OSError):
                    fcntl.ioctl(self.master, termios.TIOCSWINSZ,
                                struct.pack("HHHH", rows, cols, 0, 0))
            elif kind == CONTROL:
                with contextlib.suppress(ValueError):
                    request = json.loads(payload)
                    if isinstance(request, dict) and request.get("op") in (
                            "cont", "stop", "signal", "want"):
                        sig = request.get("signal")
                        self.job_control(str(request["op"]), sig if isinstance(sig, int) else None)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while not self.finished:
            if self.vacancy_over():
                self.end(*(self.leader.outcome() if self.leader is not None else (None, None)))
                return
            waiting = self.vacant_since is not None or (
                self.leader is not None and not self.leader.alive())
            for key, _ in self.sel.select(timeout=0.25 if waiting else 1.0):
                if key.data == "master":
                    self.read_master()
                elif key.data == "listen":
                    self.accept()
                elif key.data == "leader":
                    assert self.leader is not None
                    self.leader.reap(self)
                else:
                    self.client_input(key.fileobj)  # type: ignore[arg-type]
                if self.finished:
                    return

    def close(self, path: Any) -> None:
        """Leave nothing behind: clients see EOF, the socket file goes (if still ours)."""
        inode = os.stat(path).st_ino if isinstance(path, str) and path else None
        with contextlib.suppress(OSError):
            if inode is not None and os.stat(path).st_ino == inode:
                os.unlink(path)
        for client in list(self.clients):
            self.drop(client)


def main(argv: list[str]) -> int:
    opts, origin, _ = parse_options(argv)
    if os.fork():  # the caller does not wait for us (and a daemon gets no zombie)
        os._exit(0)
    os.setsid()
    detach_stdio()
    listener = socket.socket(fileno=int(opts["--listen-fd"]))
    holder = Holder(int(opts["--master-fd"]), listener, float(opts.get("--grace", "30")),
                    opts.get("--pinned"), origin)
    serve(holder, listener)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
