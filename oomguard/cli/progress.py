"""Progress of a long checkpoint or restore on the terminal: the bytes CRIU has written (dump)
or read (restore) so far, from its /proc/PID/io, whichever process runs it (the CLI's own CRIU
or the daemon's). Shown only on a TTY; where /proc/PID/io cannot be read, the elapsed time."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from oomguard.model.units import format_size

INTERVAL = 0.1


def dump_bytes(pid: int, proc_root: str = "/proc") -> int | None:
    """Bytes of images written so far by a running `criu dump --tree PID` (CRIU splices pages
    into its image files, so its I/O counters do not see them: the files are measured)."""
    for entry in Path(proc_root).iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace")
                    for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if not argv or not argv[0].endswith("criu") or "dump" not in argv:
            continue
        if "--tree" not in argv or argv[argv.index("--tree") + 1] != str(pid):
            continue
        if "--images-dir" not in argv:
            return None
        images = Path(argv[argv.index("--images-dir") + 1])
        try:
            return sum(p.stat().st_size for p in images.iterdir() if p.is_file())
        except OSError:
            return None
    return None


def resident_bytes(pids: list[int], proc_root: str = "/proc") -> int | None:
    """Resident memory of the tasks being restored (CRIU brings back the same PIDs)."""
    total, seen = 0, False
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in (Path(proc_root) / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    seen = True
    return total if seen else None


BAR_WIDTH = 20


def progress_line(label: str, done: int, total: int | None, elapsed: float) -> str:
    """'restore of ID: [#####...............]  25% 100.0MiB of 400.0MiB in 1.2s ' with a
    total, else 'checkpoint of 42: 100.0MiB in 1.2s '."""
    if not total:
        return f"{label}: {format_size(done)} in {elapsed:.1f}s "
    share = min(done / total, 1.0)
    filled = int(share * BAR_WIDTH)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return (f"{label}: [{bar}] {share:4.0%} {format_size(done)} of {format_size(total)} "
            f"in {elapsed:.1f}s ")


@contextlib.contextmanager
def progress(label: str, measure: Callable[[], int | None], stream: TextIO,
             total: int | None = None, interval: float = INTERVAL,
             delay: float = 0.0) -> Iterator[None]:
    """Rewrites one line on `stream` while the block runs, if `stream` is a terminal; from
    `delay` seconds on (a block over sooner shows nothing: a refused restore while waiting).
    With a `total`, a bar; a block that ends without an exception ends it at 100%."""
    if not stream.isatty():
        yield
        return
    stop = threading.Event()
    start = time.monotonic()
    seen = [0]

    def line() -> str:
        return "\r" + progress_line(label, seen[0], total, time.monotonic() - start)

    shown = [False]

    def run() -> None:
        if delay and stop.wait(delay):
            return
        shown[0] = True
        while not stop.wait(interval):
            value = measure()
            if value is not None:
                seen[0] = max(seen[0], value)
            stream.write(line())
            stream.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
        if total:  # done: whatever was last measured, all of it is there
            seen[0] = max(seen[0], total)
    finally:
        stop.set()
        thread.join()
        if shown[0]:
            stream.write(line() + os.linesep)
            stream.flush()
