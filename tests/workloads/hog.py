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
    args = parser.parse_args()

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
            chunks.append(bytes([len(chunks) % 251]) * chunk_bytes)
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


def child(path: str, tick: float) -> int:
    with open(path, "a", buffering=1) as log:
        count = 0
        while True:
            count += 1
            log.write(f"{count}\n")
            time.sleep(tick)


if __name__ == "__main__":
    sys.exit(main())
