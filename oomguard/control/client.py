"""The CLI's side of the control socket."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from oomguard.control.protocol import INTERFACE, FrameBuffer, encode
from oomguard.model.errors import OomguardError

CALL_TIMEOUT = 900.0  # a restore or checkpoint of many GiB takes a while


class ControlError(OomguardError):
    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(message)


class DaemonUnavailable(OomguardError):
    """No daemon answers on the socket."""


class ControlClient:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_TIMEOUT)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise DaemonUnavailable(f"no oomguard daemon on {path}: {exc.strerror}") from exc
        self.frames = FrameBuffer(limit=1 << 30)

    def call(self, method: str, **parameters: Any) -> dict[str, Any]:
        message = {"method": f"{INTERFACE}.{method}",
                   "parameters": {k: v for k, v in parameters.items() if v is not None}}
        self.sock.sendall(encode(message))
        while True:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ControlError("disconnected", "the daemon closed the connection")
            frames = self.frames.feed(chunk)
            if frames:
                answer = json.loads(frames[0])
                break
        if "error" in answer:
            raise ControlError(answer["error"], answer.get("parameters", {}).get("message", ""))
        result: dict[str, Any] = answer.get("parameters", {})
        return result

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
