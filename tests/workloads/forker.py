"""A workload that forks a short-lived child every few milliseconds while it grows: a fork
racing the freeze must not escape it (drill)."""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    log_path, target_mib = sys.argv[1], int(sys.argv[2])
    chunks = []
    count = 0
    with open(log_path, "a", buffering=1) as log:
        while True:
            count += 1
            if len(chunks) * 4 < target_mib:
                chunks.append(bytes([count % 251]) * (4 << 20))
            pid = os.fork()
            if pid == 0:
                time.sleep(0.02)
                os._exit(0)
            log.write(f"{count} {len(chunks) * 4}\n")
            time.sleep(0.005)
            while True:  # reap what has finished
                try:
                    done, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if done == 0:
                    break


if __name__ == "__main__":
    sys.exit(main())
