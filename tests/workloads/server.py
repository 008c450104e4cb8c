"""A TCP server that counts: the workload of the server-under-load test.

Listens on 127.0.0.1 (an ephemeral port, written to `--port-file`), holds `--hold` MiB, and
answers each connection with the number of connections it has accepted so far, then closes it.
After a checkpoint and restore it must listen on the same port and go on counting.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--hold", type=int, default=0, help="MiB to hold")
    args = parser.parse_args()
    held = [bytes([i % 251]) * (1 << 20) for i in range(args.hold)]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    tmp = f"{args.port_file}.tmp"
    with open(tmp, "w") as handle:
        handle.write(f"{listener.getsockname()[1]}\n")
    os.replace(tmp, args.port_file)
    served = 0
    while True:
        conn, _ = listener.accept()
        served += 1
        try:
            conn.sendall(f"{served} {len(held)}\n".encode())
        except OSError:
            pass
        finally:
            conn.close()


if __name__ == "__main__":
    sys.exit(main())
