"""The daemon's control socket: one thread per connection, callers identified by SO_PEERCRED."""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard import __version__
from oomguard.control.protocol import (
    ERROR_DENIED,
    ERROR_FAILED,
    ERROR_INVALID,
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
    param,
    reply,
)
from oomguard.errors import CheckpointFailed, NoRoom, OomguardError, StoreError
from oomguard.service import PermissionDenied, Service

IDLE_TIMEOUT = 120.0  # a client that says nothing for this long is dropped


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
        if method == "Status":
            return method, reply({"status": service.status(uid)})
        if method == "List":
            return method, reply({"checkpoints": service.list(uid)})
        if method == "Show":
            return method, reply({"checkpoint": service.show(uid, param(p, "id", str))})
        if method == "Restore":
            return method, reply(service.restore(
                uid, param(p, "id", str), param(p, "cgroup", str, required=False),
                bool(param(p, "force", bool, required=False))))
        if method == "Forget":
            return method, reply(service.forget(uid, param(p, "id", str)))
        if method == "Checkpoint":
            reason = param(p, "reason", str, required=False) or "on demand (control socket)"
            return method, reply({"checkpoint": service.checkpoint(
                uid, param(p, "pid", int), reason, requester=pid)})
        if method == "GpuResume":
            return method, reply(service.gpu_resume(uid, param(p, "pid", int)))
        return method, error(ERROR_METHOD, f"no method {method!r}")
    except ProtocolError as exc:
        return method, error(ERROR_INVALID, str(exc))
    except PermissionDenied as exc:
        return method, error(ERROR_DENIED, str(exc))
    except StoreError as exc:
        kind = ERROR_NOT_FOUND if str(exc).startswith("no checkpoint") else ERROR_INVALID \
            if "invalid checkpoint id" in str(exc) else ERROR_FAILED
        return method, error(kind, str(exc))
    except CheckpointFailed as exc:
        return method, error(ERROR_FAILED, f"{exc} (process {exc.outcome})")
    except NoRoom as exc:
        return method, error(ERROR_NO_ROOM, str(exc))
    except OomguardError as exc:
        return method, error(ERROR_FAILED, str(exc))


class _Handler(socketserver.BaseRequestHandler):
    server: ControlServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(IDLE_TIMEOUT)
        try:
            pid, uid, _gid = peer_credentials(sock)
        except OSError:
            return
        frames = FrameBuffer()
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            try:
                calls = frames.feed(chunk)
            except ProtocolError as exc:
                with contextlib.suppress(OSError):
                    sock.sendall(encode(error(ERROR_INVALID, str(exc))))
                self.server.note("control.rejected", uid=uid, pid=pid, error=str(exc))
                return
            for raw in calls:
                method, message = self.server.dispatcher(self.server.service, raw, uid, pid)
                self.server.note("control.call", uid=uid, pid=pid, method=method,
                                 error=message.get("error"))
                try:
                    sock.sendall(encode(message))
                except OSError:
                    return


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
    daemon_threads = True

    def __init__(self, path: Path, service: Service,
                 note: Callable[..., None] | None = None,
                 dispatcher: Callable[[Service, bytes, int, int],
                                      tuple[str, dict[str, Any]]] = dispatch,
                 mode: int = 0o666) -> None:
        self.service = service
        self.dispatcher = dispatcher
        self.path = path
        self.note = note or (lambda *args, **kwargs: None)
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
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="oomguard-control",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
