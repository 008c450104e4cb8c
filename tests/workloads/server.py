"""A TCP server that counts: the workload of the server-under-load test.

Listens on 127.0.0.1 (an ephemeral port, written to `--port-file`), holds `--hold` MiB, and
answers each connection with the number of connections it has accepted so far, then closes it.
While the file `--stall-file` names exists it accepts nothing (a server busy elsewhere), so the
kernel queues the clients' connections in its accept queue: in flight at a checkpoint.
After a checkpoint and restore it must listen on the same port and go on counting.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--hold", type=int, default=0, help="MiB to hold")
    parser.add_argument("--stall-file", default="", help="accept nothing while it exists")
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
        while args.stall_file and os.path.exists(args.stall_file):
            time.sleep(0.005)
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
