"""A job that counts a line a step and grows 4 MiB a step to TARGET MiB, each chunk filled
with its own byte; at COUNT it checks every chunk and writes "done COUNT ok" (or CORRUPT).
With --link SOCKET it first connects to a Unix stream server there (outside its tree: a
connection CRIU cannot dump). The page-out's tests and bench/undumpable.py run it.

    python3 chunks.py --log LOG --target MIB --count N [--link SOCKET]
"""

import argparse
import socket
import time

parser = argparse.ArgumentParser()
parser.add_argument("--log", required=True)
parser.add_argument("--target", type=int, required=True)
parser.add_argument("--count", type=int, required=True)
parser.add_argument("--link")
args = parser.parse_args()
if args.link:
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.connect(args.link)
log = open(args.log, "a", buffering=1)  # noqa: SIM115
chunks: list[bytes] = []
for count in range(1, args.count + 1):
    if len(chunks) * 4 < args.target:
        chunks.append(bytes([len(chunks) % 251]) * (4 << 20))
    log.write(f"{count} {len(chunks) * 4}\n")
    time.sleep(0.02)
ok = all(c == bytes([i % 251]) * (4 << 20) for i, c in enumerate(chunks))
log.write(f"done {args.count} {'ok' if ok else 'CORRUPT'}\n")
