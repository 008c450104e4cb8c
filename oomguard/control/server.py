"""The daemon's control socket: one thread per connection, callers identified by SO_PEERCRED."""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard import __version__
from oomguard.control.limits import (
    CALL_RATE,
    IDLE_TIMEOUT,
    MAX_BAD_REQUESTS,
    REQUEST_DEADLINE,
    CallRate,
    CallSummary,
    ConnectionLimiter,
    LogThrottle,
)
from oomguard.control.protocol import (
    ERROR_AMBIGUOUS,
    ERROR_DENIED,
    ERROR_FAILED,
    ERROR_INVALID,
    ERROR_LIMIT,
    ERROR_METHOD,
    ERROR_NO_ROOM,
    ERROR_NOT_FOUND,
    INTERFACE,
    INTERFACE_DESCRIPTION,
    FrameBuffer,
    ProtocolError,
    decode_call,
    encode,
    error,
    reply,
)
from oomguard.control.service import ROOT, PermissionDenied, Service
from oomguard.control.verbs import VERBS, Caller
from oomguard.model.errors import (
    AmbiguousId,
    CheckpointFailed,
    NeverFits,
    NoRoom,
    OomguardError,
    StoreError,
)
from oomguard.model.quietserve import QuietServing

# Calls that change something are always logged; the others (Status, List, GetInfo...)
# that succeed are logged at debug, and counted in one summary line a minute.
ACTING = frozenset({"Checkpoint", "Restore", "Forget", "GpuResume"})
SUMMARY_WINDOW = 60.0


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def dispatch(service: Service, raw: bytes, uid: int, pid: int | None = None,
             ) -> tuple[str, dict[str, Any]]:
    """One call from process `pid` of user `uid` -> (method name for the log, reply message).
    Never raises."""
    method = "?"
    try:
        call = decode_call(raw)
        method = call.method
        p = call.parameters
        if method == "org.varlink.service.GetInfo":
            return method, reply({"vendor": "oomguard", "product": "oomguard",
                                  "version": __version__, "url": "", "interfaces": [INTERFACE]})
        if method == "org.varlink.service.GetInterfaceDescription":
            return method, reply({"description": INTERFACE_DESCRIPTION})
        verb = VERBS.get(method)
        if verb is None:
            return method, error(ERROR_METHOD, f"no method {method!r}")
        return method, reply(verb(service, Caller(uid, pid, socket=True), p))
    except ProtocolError as exc:
        return method, error(ERROR_INVALID, str(exc))
    except PermissionDenied as exc:
        return method, error(ERROR_DENIED, str(exc))
    except AmbiguousId as exc:
        return method, error(ERROR_AMBIGUOUS, str(exc))
    except StoreError as exc:
        kind = ERROR_NOT_FOUND if str(exc).startswith("no checkpoint") else ERROR_INVALID \
            if "invalid checkpoint id" in str(exc) else ERROR_FAILED
        return method, error(kind, str(exc))
    except CheckpointFailed as exc:
        return method, error(ERROR_FAILED, f"{exc} (process {exc.outcome})")
    except NeverFits as exc:  # not "no room now": a waiting client would wait forever
        return method, error(ERROR_FAILED, str(exc))
    except NoRoom as exc:
        return method, error(ERROR_NO_ROOM, str(exc))
    except OomguardError as exc:
        return method, error(ERROR_FAILED, str(exc))


class _Handler(socketserver.BaseRequestHandler):
    server: ControlServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        pid, uid = self.server.peer_of(sock)
        frames = FrameBuffer()
        pending_since: float | None = None  # when the first byte of an unfinished request came
        bad = 0
        idle = self.server.idle_timeout
        deadline = min(REQUEST_DEADLINE, idle)
        while True:
            now = time.monotonic()
            wait = idle if pending_since is None else pending_since + deadline - now
            if wait <= 0:
                self._refuse(sock, pid, uid, f"request not completed within "
                             f"{deadline:g}s: connection closed")
                return
            sock.settimeout(wait)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if pending_since is None:  # idle for the idle timeout: dropped
                    self.server.note_idle(uid=uid, pid=pid)
                    return
                continue  # a request past its deadline: refused at the top of the loop
            except OSError:
                return
            if not chunk:
                return
            try:
                calls = frames.feed(chunk)
            except ProtocolError as exc:
                self._refuse(sock, pid, uid, str(exc))
                return
            if not frames.data:
                pending_since = None
            elif calls or pending_since is None:
                pending_since = time.monotonic()
            for raw in calls:
                self.server.pace(uid, pid)
                method, message = self.server.dispatcher(self.server.service, raw, uid, pid)
                failed = message.get("error")
                if failed == ERROR_INVALID:
                    bad += 1
                self.server.note_call(uid=uid, pid=pid, method=method, error=failed)
                try:
                    sock.sendall(encode(message))
                except OSError:
                    return
                if bad >= MAX_BAD_REQUESTS:
                    self._refuse(sock, pid, uid, f"{bad} malformed requests: connection closed")
                    return

    def _refuse(self, sock: socket.socket, pid: int, uid: int, why: str) -> None:
        with contextlib.suppress(OSError):
            sock.settimeout(1.0)
            sock.sendall(encode(error(ERROR_INVALID, why)))
        self.server.note_rejected(uid=uid, pid=pid, error=why)


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """One thread per connection, at most MAX_CONNECTIONS (MAX_PER_UID per user, ROOT_RESERVE
    for root alone); a request must arrive whole within REQUEST_DEADLINE, a connection that
    starts none for `idle_timeout` is closed; a user's calls beyond `call_rate` a second wait
    their turn; what is logged of calls and rejections is bounded per uid."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, path: Path, service: Service,
                 note: Callable[..., None] | None = None,
                 dispatcher: Callable[[Service, bytes, int, int],
                                      tuple[str, dict[str, Any]]] = dispatch,
                 mode: int = 0o666, idle_timeout: float = IDLE_TIMEOUT,
                 call_rate: float = CALL_RATE,
                 debug: Callable[..., None] | None = None) -> None:
        self.service = service
        self.idle_timeout = idle_timeout
        self.dispatcher = dispatcher
        self.path = path
        self.note = note or (lambda *args, **kwargs: None)
        self.debug = debug or (lambda *args, **kwargs: None)
        self.limiter = ConnectionLimiter()
        self.throttle = LogThrottle()
        self.rate = CallRate(rate=call_rate, burst=max(call_rate * 2, 1.0))
        self.quiet = LogThrottle(burst=1, window=60.0)  # once a minute per uid and kind
        self.routine = CallSummary(window=SUMMARY_WINDOW)
        self._peers: dict[int, tuple[int, int]] = {}  # id(socket) -> (pid, uid), admitted ones
        self._peers_lock = threading.Lock()
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise OSError(f"{path} exists and is not a socket: refusing to replace it")
            if _answers(path):
                raise OSError(f"another oomguard daemon answers on {path}")
            path.unlink()  # a stale socket of a previous run
        super().__init__(str(path), _Handler)
        # Anyone may connect; what each caller may see is decided per call from SO_PEERCRED.
        os.chmod(path, mode)
        self._serving: QuietServing | None = None

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Runs in the accepting thread before a handler thread is started: a connection over
        the limits is answered with the reason and closed at once."""
        sock: socket.socket = request
        try:
            pid, uid, _gid = peer_credentials(sock)
        except OSError:
            return False
        refused = self.limiter.admit(uid)
        if refused is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(0.2)
                sock.sendall(encode(error(ERROR_LIMIT, refused)))
            self.note_rejected(uid=uid, pid=pid, error=refused)
            return False
        with self._peers_lock:
            self._peers[id(sock)] = (pid, uid)
        return True

    def shutdown_request(self, request: Any) -> None:
        with self._peers_lock:
            peer = self._peers.pop(id(request), None)
        if peer is not None:
            self.limiter.release(peer[1])
        super().shutdown_request(request)

    def peer_of(self, sock: socket.socket) -> tuple[int, int]:
        with self._peers_lock:
            return self._peers[id(sock)]

    def pace(self, uid: int, pid: int) -> None:
        """Before a call of a user's is served: its turn under the user's rate (root's calls
        are never held). Being held is logged once a minute per uid, not per call."""
        if uid == ROOT:
            return
        wait = self.rate.delay(uid)
        if wait <= 0:
            return
        allowed, suppressed = self.quiet.allow(("rate", uid))
        if allowed:
            self.note("control.rate_limited", uid=uid, pid=pid, rate=self.rate.rate,
                      suppressed=suppressed or None,
                      explanation=f"uid {uid} calls more than {self.rate.rate:g} times a "
                      "second: its calls are answered at that rate")
        time.sleep(wait)

    def note_call(self, *, uid: int, pid: int, method: str, error: object) -> None:
        """Calls that act are all logged; routine ones that succeed at debug, and in one
        `control.calls` summary a minute; failed ones at a bounded rate per uid
        (`suppressed`: how many went unlogged since the last line)."""
        if error is None:
            if method in ACTING:
                self.note("control.call", uid=uid, pid=pid, method=method, error=None)
                return
            self.debug("control.call", uid=uid, pid=pid, method=method, error=None)
            summary = self.routine.add(uid, method)
            if summary is not None:
                self.note("control.calls", **summary,
                          explanation="routine calls answered (by uid and method) since the "
                          "last such line; each is logged at debug")
            return
        allowed, suppressed = self.throttle.allow(("call", uid))
        if allowed:
            self.note("control.call", uid=uid, pid=pid, method=method, error=error,
                      suppressed=suppressed or None)

    def note_rejected(self, *, uid: int, pid: int, error: str) -> None:
        allowed, suppressed = self.throttle.allow(("rejected", uid))
        if allowed:
            self.note("control.rejected", uid=uid, pid=pid, error=error,
                      suppressed=suppressed or None)

    def note_idle(self, *, uid: int, pid: int) -> None:
        allowed, suppressed = self.quiet.allow(("idle", uid))
        if allowed:
            self.note("control.idle_closed", uid=uid, pid=pid, idle_s=self.idle_timeout,
                      suppressed=suppressed or None,
                      explanation="a connection that starts no request for this long is "
                      "closed (daemon.control_idle_timeout)")

    def start(self) -> None:
        self._serving = QuietServing(self, "oomguard-control")
        self._serving.start()

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.stop()
            self._serving = None
        self.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
