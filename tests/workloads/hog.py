"""A memory hog that counts: the workload of the integration tests and benchmarks.

Grows by `--chunk` MiB at `--rate` MiB/s up to `--target` MiB, filling every chunk with a
pattern, and appends "<count> <mib>" to `--log` (an open file it keeps appending to) after every
step. Once at the target it keeps counting, one line per `--tick` seconds, until `--count`
steps, then checks that every chunk still holds its pattern and writes "done <count> ok".
After a checkpoint and restore it must go on from its last count, with its memory intact.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    stamps = Stamps(args.stamps, args.usage_file, args.cross_at)

    kids = []
    for index in range(args.children):
        pid = os.fork()
        if pid == 0:
            return child(f"{args.log}.child{index}", args.tick)
        kids.append(pid)

    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - held open on purpose
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
        log.write(f"{count} {len(chunks) * args.chunk}\n")
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
