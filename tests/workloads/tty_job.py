"""A counting job for the terminal tests: grows to `--target` MiB at `--rate` MiB/s, then keeps
counting; every step prints "count N" on stdout (a terminal, or a redirected log) and appends
"N" to `--log`. A line typed on stdin is answered "echo: LINE" (and logged "input LINE").
`--daemonize` forks, the parent exits 0 and the child carries on (a daemon under exec).
Ends with "done N ok" (memory intact) on stdout and in the log, and status `--exit` (0)."""

from __future__ import annotations

import argparse
import os
import select
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--target", type=int, default=64)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--tick", type=float, default=0.05)
    parser.add_argument("--daemonize", action="store_true")
    parser.add_argument("--exit", type=int, default=0, help="the status to end with")
    args = parser.parse_args()
    if args.daemonize and os.fork() > 0:
        return 0
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - held open on purpose
    log.write(f"start tty={int(os.isatty(0))}\n")
    chunks: list[bytes] = []
    start = time.monotonic()
    pending = b""
    watch = [0]  # stdin, until it reaches its end
    for count in range(1, args.count + 1):
        if len(chunks) * 4 < args.target:
            chunks.append(bytes([len(chunks) % 251]) * (4 << 20))
            delay = start + len(chunks) * 4 / args.rate - time.monotonic()
        else:
            delay = args.tick
        if select.select(watch, [], [], max(delay, 0))[0]:
            data = os.read(0, 1024)
            if not data:
                watch = []
                time.sleep(max(delay, 0))
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                log.write(f"input {text}\n")
                sys.stdout.write(f"echo: {text}\n")
        sys.stdout.write(f"count {count}\n")
        sys.stdout.flush()
        log.write(f"{count}\n")
    intact = all(c == bytes([i % 251]) * (4 << 20) for i, c in enumerate(chunks))
    line = f"done {args.count} {'ok' if intact else 'CORRUPT'}"
    print(line, flush=True)
    log.write(line + "\n")
    return args.exit if intact else 1


if __name__ == "__main__":
    sys.exit(main())
