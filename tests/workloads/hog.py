"""A memory hog that counts: the workload of the integration tests and benchmarks.

Grows by `--chunk` MiB at `--rate` MiB/s up to `--target` MiB, filling every chunk with a
pattern, and appends "<count> <mib>" to `--log` (an open file it keeps appending to) after every
step. Once at the target it keeps counting, one line per `--tick` seconds, until `--count`
steps, then checks that every chunk still holds its pattern and writes "done <count> ok".
After a checkpoint and restore it must go on from its last count, with its memory intact.

With `--write FILE` every step also appends `--write-kib` KiB to FILE through write(2) (page
cache charged to the hog's memory cgroup as it is written; the file starts again from empty at
`--write-max` MiB, so that new page cache keeps being charged). Any error of a system call
(ENOMEM from a write at the cgroup's limit) ends the hog with the errno as its exit status
(12: ENOMEM) and a line "hog: error ERRNO in WHAT" on stderr and in the log, where they can
still be written (at the limit they often cannot).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--target", type=int, default=256, help="MiB to hold")
    parser.add_argument("--rate", type=float, default=100.0, help="MiB/s while growing")
    parser.add_argument("--chunk", type=int, default=4, help="MiB per step")
    parser.add_argument("--count", type=int, default=1_000_000, help="steps before done")
    parser.add_argument("--tick", type=float, default=0.05, help="seconds per step once grown")
    parser.add_argument("--children", type=int, default=0, help="forked children that also count")
    parser.add_argument("--stamps", help="benchmarks: JSON lines of wall-clock times (start, "
                        "step: before a step that may cross --cross-at, cross: the cgroup's usage reached "
                        "it, grown: at --target)")
    parser.add_argument("--usage-file", help="the cgroup's usage file, read after every chunk")
    parser.add_argument("--cross-at", type=int, default=0, help="bytes of usage for 'cross'")
    parser.add_argument("--write", help="a file to append to through write(2) at every step")
    parser.add_argument("--write-kib", type=int, default=256, help="KiB written per step")
    parser.add_argument("--write-max", type=int, default=64, help="MiB before FILE restarts")
    args = parser.parse_args()
    try:
        return grow(args)
    except OSError as exc:
        where = getattr(exc, "where", "a system call")
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        report(args.log, f"hog: error {name} in {where}: {exc}")
        os._exit(min(max(exc.errno or 1, 1), 125))  # the errno: 12 is ENOMEM


def report(log: str, line: str) -> None:
    """Said on stderr and in the log, as far as either can still be written."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())
    with contextlib.suppress(OSError), open(log, "a") as handle:
        handle.write(line + "\n")


class Writer:
    """Appends `kib` KiB through write(2) per step; the file starts again at `max_mib`."""

    def __init__(self, path: str | None, kib: int, max_mib: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if path else None
        self.block = b"w" * (kib << 10)
        self.max_bytes = max_mib << 20
        self.written = 0

    def step(self) -> None:
        if self.fd is None:
            return
        if self.written + len(self.block) > self.max_bytes:
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
            self.written = 0
        try:
            done = os.write(self.fd, self.block)
        except OSError as exc:
            exc.where = "write(2) of the data file"  # type: ignore[attr-defined]
            raise
        self.written += done


def grow(args: argparse.Namespace) -> int:
    stamps = Stamps(args.stamps, args.usage_file, args.cross_at)

    kids = []
    for index in range(args.children):
        pid = os.fork()
        if pid == 0:
            return child(f"{args.log}.child{index}", args.tick)
        kids.append(pid)

    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - held open on purpose
    writer = Writer(args.write, args.write_kib, args.write_max)
    chunks: list[bytes] = []
    chunk_bytes = args.chunk << 20
    start = time.monotonic()
    count = 0
    while count < args.count:
        count += 1
        if len(chunks) * args.chunk < args.target:
            stamps.before_chunk(len(chunks) * chunk_bytes, chunk_bytes)
            chunks.append(bytes([len(chunks) % 251]) * chunk_bytes)
            stamps.after_chunk(len(chunks) * chunk_bytes, len(chunks) * args.chunk >= args.target)
            due = start + len(chunks) * args.chunk / args.rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        else:
            time.sleep(args.tick)
        writer.step()
        try:
            log.write(f"{count} {len(chunks) * args.chunk}\n")
        except OSError as exc:
            exc.where = "write(2) of the log"  # type: ignore[attr-defined]
            raise
    intact = all(c == bytes([i % 251]) * chunk_bytes for i, c in enumerate(chunks))
    log.write(f"done {count} {'ok' if intact else 'CORRUPT'}\n")
    log.close()
    for pid in kids:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    return 0 if intact else 1


class Stamps:
    """Wall-clock marks for the benchmarks (time.time(): comparable with the daemon's event
    timestamps). Costs nothing when --stamps is not given."""

    def __init__(self, path: str | None, usage_file: str | None, cross_at: int) -> None:
        self.out = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self.usage_file = usage_file if cross_at > 0 else None
        self.cross_at = cross_at
        self.grown = False
        self.mark("start")

    def mark(self, event: str, **fields: int) -> None:
        if self.out is not None:
            extra = "".join(f', "{key}": {value}' for key, value in fields.items())
            self.out.write(f'{{"event": "{event}", "t": {time.time():.6f}{extra}}}\n')

    def before_chunk(self, allocated: int, chunk_bytes: int) -> None:
        """'step': the time before an allocation step that may cross --cross-at (usage within
        two steps of it). The daemon may stop the hog inside the step that crosses, before
        'cross' is written: the last 'step' then bounds when the crossing began."""
        if self.out is None or self.usage_file is None:
            return
        with open(self.usage_file) as handle:
            usage = int(handle.read())
        if usage + 2 * chunk_bytes >= self.cross_at:
            self.mark("step", usage=usage, allocated=allocated)

    def after_chunk(self, allocated: int, grown: bool) -> None:
        if self.out is None:
            return
        if self.usage_file is not None:
            with open(self.usage_file) as handle:
                usage = int(handle.read())
            if usage >= self.cross_at:
                self.mark("cross", usage=usage, allocated=allocated)
                self.usage_file = None
        if grown and not self.grown:
            self.grown = True
            self.mark("grown", allocated=allocated)


def child(path: str, tick: float) -> int:
    with open(path, "a", buffering=1) as log:
        count = 0
        while True:
            count += 1
            log.write(f"{count}\n")
            time.sleep(tick)


if __name__ == "__main__":
    sys.exit(main())
