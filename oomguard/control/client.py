"""The CLI's side of the control socket."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path
from typing import Any

from oomguard.control.protocol import INTERFACE, FrameBuffer, ProtocolError, encode
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
        try:
            self.sock.sendall(encode(message))
        except OSError as exc:  # refused and closed at once (the reason waits to be read)
            answer = self._last_word(exc)
        else:
            answer = self._answer()
        if "error" in answer:
            raise ControlError(answer["error"], answer.get("parameters", {}).get("message", ""))
        result: dict[str, Any] = answer.get("parameters", {})
        return result

    def _answer(self) -> dict[str, Any]:
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                raise ControlError("timeout", f"no answer from the daemon within "
                                   f"{self.sock.gettimeout():g}s") from None
            except OSError as exc:
                return self._last_word(exc)
            if not chunk:
                raise ControlError("disconnected", "the daemon closed the connection")
            frames = self.frames.feed(chunk)
            if frames:
                return self._decode(frames[0])

    def _last_word(self, exc: OSError) -> dict[str, Any]:
        """What the daemon said before it closed the connection (why it refused it), else
        an error saying it closed it."""
        self.sock.settimeout(1.0)
        with contextlib.suppress(OSError, ProtocolError):
            while chunk := self.sock.recv(1 << 16):
                frames = self.frames.feed(chunk)
                if frames:
                    return self._decode(frames[0])
        raise ControlError("disconnected", f"the daemon closed the connection "
                           f"({exc.strerror or exc})")

    @staticmethod
    def _decode(frame: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(frame)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ControlError("garbled", "the daemon's answer is not a JSON object")
        return answer

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
