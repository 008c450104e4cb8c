"""The attach protocol between a pty holder (oomguard/terminal/holder.py) and its clients
(`oomguard exec`, `attach`, `restore` on a terminal). Stdlib only: the holder imports it.

After a one-line JSON request and the holder's one-line JSON answer, both sides send frames:
1 byte kind, 4 bytes length (big-endian), payload.

client -> holder: INPUT (keys for the job), WINDOW (rows, cols as two u16), CONTROL (JSON:
  {"op": "cont"} continues a stopped job, as `fg` does; {"op": "stop"} stops it, as Ctrl-Z;
  {"op": "signal", "signal": N} sends it the signal).
holder -> client (a client that asked for frames): OUTPUT (the job's bytes) and STATE (JSON, a
  JobState: whether the job has the terminal, is stopped, was checkpointed, ended)."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import Any

FRAME = struct.Struct(">cI")
INPUT, WINDOW, CONTROL = b"d", b"w", b"c"
OUTPUT, STATE = b"o", b"s"
MAX_FRAME = 1 << 20


def frame(kind: bytes, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def json_frame(kind: bytes, fields: dict[str, Any]) -> bytes:
    return frame(kind, json.dumps(fields).encode())


def window_frame(rows: int, cols: int) -> bytes:
    return frame(WINDOW, struct.pack(">HH", rows, cols))


class FrameReader:
    """Frames out of a byte stream that arrives in pieces."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The whole frames now in the buffer; raises ValueError on a frame too large."""
        self.buffer += data
        frames = []
        while len(self.buffer) >= FRAME.size:
            kind, length = FRAME.unpack_from(self.buffer)
            if length > MAX_FRAME:
                raise ValueError(f"frame of {length} bytes")
            if len(self.buffer) < FRAME.size + length:
                break
            frames.append((kind, self.buffer[FRAME.size:FRAME.size + length]))
            self.buffer = self.buffer[FRAME.size + length:]
        return frames


@dataclass(frozen=True)
class JobState:
    """What a holder knows of its job. `terminal`: the job has the terminal's foreground (it
    asked for input, or set the terminal's modes): a client passes it the keys. `stopped`:
    stopped by job control (Ctrl-Z). `dumping`/`pinned`: a checkpoint is being taken / was
    taken (its id). `ended`: the job is over; `status` its exit status or `signal` the
    signal that ended it, where known."""

    terminal: bool = False
    stopped: bool = False
    dumping: str | None = None
    pinned: str | None = None
    ended: bool = False
    status: int | None = None
    signal: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(fields: dict[str, Any]) -> JobState:
        def opt_int(name: str) -> int | None:
            value = fields.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        def opt_str(name: str) -> str | None:
            value = fields.get(name)
            return value if isinstance(value, str) and value else None

        return JobState(terminal=fields.get("terminal") is True,
                        stopped=fields.get("stopped") is True,
                        dumping=opt_str("dumping"), pinned=opt_str("pinned"),
                        ended=fields.get("ended") is True,
                        status=opt_int("status"), signal=opt_int("signal"))


def describe_end(state: JobState) -> str:
    """'exited with status 3', 'killed by SIGTERM', or 'ended' (status unknown)."""
    if state.signal is not None:
        import signal

        try:
            name = signal.Signals(state.signal).name
        except ValueError:
            name = f"signal {state.signal}"
        return f"killed by {name}"
    if state.status is not None:
        return f"exited with status {state.status}"
    return "ended"


def shell_status(state: JobState) -> int:
    """The job's end as a shell's $? (128+N for signal N; 0 when unknown)."""
    if state.signal is not None:
        return 128 + state.signal
    return state.status if state.status is not None else 0
