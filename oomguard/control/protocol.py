"""Wire format of the control socket (documented in docs/control-protocol.md).

varlink framing: each message is one JSON object followed by a NUL byte, on a UNIX stream
socket. A call is {"method": "io.oomguard.List", "parameters": {...}}; a reply is
{"parameters": {...}} or {"error": "io.oomguard.PermissionDenied", "parameters":
{"message": "..."}}. systemd's `varlinkctl call SOCKET METHOD JSON` can talk to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INTERFACE = "io.oomguard"
MAX_MESSAGE = 64 * 1024
METHODS = ("Status", "List", "Show", "Restore", "Forget", "Checkpoint", "GpuResume")

ERROR_INVALID = f"{INTERFACE}.InvalidRequest"
ERROR_DENIED = f"{INTERFACE}.PermissionDenied"
ERROR_NOT_FOUND = f"{INTERFACE}.NotFound"
ERROR_FAILED = f"{INTERFACE}.Failed"
ERROR_LIMIT = f"{INTERFACE}.TooManyConnections"
ERROR_NO_ROOM = f"{INTERFACE}.NoRoom"  # a restore that does not fit now (may fit later)
ERROR_AMBIGUOUS = f"{INTERFACE}.AmbiguousId"  # an id prefix that matches several checkpoints
ERROR_METHOD = "org.varlink.service.MethodNotFound"

INTERFACE_DESCRIPTION = f"""interface {INTERFACE}

method Status() -> (status: object)
method List() -> (checkpoints: []object, skipped: []object)
method Show(id: string) -> (checkpoint: object)
method Restore(id: string, cgroup: ?string, force: ?bool, lazy: ?bool)
  -> (id: string, pid: int, seconds: float, verify_s: float, total_s: float, lazy: bool,
      lazy_fallback: ?string, warmed_bytes: int, cgroup: ?string)
method Forget(id: string) -> (id: string)
method Checkpoint(pid: int, reason: ?string) -> (checkpoint: object)
method GpuResume(pid: int) -> (pid: int)

error InvalidRequest (message: string)
error PermissionDenied (message: string)
error NotFound (message: string)
error Failed (message: string)
error TooManyConnections (message: string)
error NoRoom (message: string)
error AmbiguousId (message: string)
"""


class ProtocolError(Exception):
    """A message that is not a valid call."""


@dataclass(frozen=True)
class Call:
    method: str  # the short name, e.g. "List", or a full org.varlink.service name
    parameters: dict[str, Any]


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\0"


def decode_call(raw: bytes) -> Call:
    try:
        message = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError("message is not JSON") from exc
    except RecursionError:
        raise ProtocolError("message is nested too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    method = message.get("method")
    parameters = message.get("parameters", {})
    if not isinstance(method, str) or not method:
        raise ProtocolError("no method")
    if not isinstance(parameters, dict):
        raise ProtocolError("parameters is not an object")
    prefix = INTERFACE + "."
    short = method[len(prefix):] if method.startswith(prefix) else method
    return Call(method=short, parameters=parameters)


def reply(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"parameters": parameters}


def error(name: str, message: str) -> dict[str, Any]:
    return {"error": name, "parameters": {"message": message}}


class FrameBuffer:
    """Accumulates bytes from a stream and yields complete NUL-terminated frames."""

    def __init__(self, limit: int = MAX_MESSAGE) -> None:
        self.data = b""
        self.limit = limit

    def feed(self, chunk: bytes) -> list[bytes]:
        self.data += chunk
        frames = []
        while b"\0" in self.data:
            frame, _, self.data = self.data.partition(b"\0")
            if len(frame) > self.limit:
                raise ProtocolError(f"message larger than {self.limit} bytes")
            frames.append(frame)
        if len(self.data) > self.limit:
            raise ProtocolError(f"message larger than {self.limit} bytes")
        return frames


def param(parameters: dict[str, Any], name: str, kind: type, required: bool = True) -> Any:
    value = parameters.get(name)
    if value is None:
        if required:
            raise ProtocolError(f"missing parameter {name!r}")
        return None
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ProtocolError(f"parameter {name!r} must be {kind.__name__}")
    return value
