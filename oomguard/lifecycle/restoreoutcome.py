"""What a restore says at its end: its result (RestoreResult), or its failure in one line
with CRIU's own cause (for the error raised and the `restore.failed` event)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from oomguard.model.errors import CriuError
from oomguard.store.checkpoints import CheckpointMeta


@dataclass(frozen=True)
class RestoreResult:
    meta: CheckpointMeta
    pid: int
    seconds: float  # CRIU's restore, until the tree runs
    # Checking the images against their checksums: all but the pages before CRIU, the pages
    # while CRIU reads them (so it overlaps `seconds`)
    verify_s: float = 0.0
    total_s: float = 0.0  # from the first check to the tree running
    lazy: bool = False  # its memory streams in after it runs (oomguard/lifecycle/lazyrestore.py)
    lazy_fallback: str | None = None  # asked to be lazy, restored eagerly: why
    warmed_bytes: int = 0  # lazily: the job's small runs asked into the page cache first
    gpu_pids: tuple[int, ...] = ()  # host pids whose CUDA state was put back on the GPU
    gpu_error: str | None = None  # ...or why it could not be (the process runs, CUDA locked)
    stopped_pids: tuple[int, ...] = ()  # host pids left stopped, as the user had stopped them


def criu_cause(exc: CriuError) -> str:
    """What CRIU said first in its log (the cause; later errors follow from it), without its
    timestamp and source location; "" where its log says no error."""
    first = next((line for line in exc.log_tail.splitlines() if "Error" in line), "")
    return re.sub(r"^\(\s*[\d.]+\)\s*(\d+:\s*)?Error \([^)]*\):\s*", "", first.strip())


def one_line(exc: CriuError) -> str:
    """CRIU's failure in one line: its message and CRIU's own cause."""
    cause = criu_cause(exc)
    head = str(exc).splitlines()[0] if str(exc) else "criu restore failed"
    return f"{head}: {cause}" if cause else head


def failure_fields(exc: BaseException) -> dict[str, str]:
    """The fields of a `restore.failed` event: the error in one line and, where CRIU failed,
    CRIU's own error line (criu_error)."""
    text = str(exc).strip()
    fields = {"error": text.splitlines()[0] if text else type(exc).__name__}
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, CriuError):
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, CriuError) and criu_cause(seen):
        fields["criu_error"] = criu_cause(seen)
    return fields
