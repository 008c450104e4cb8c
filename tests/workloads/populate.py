"""A job whose memory comes in one system call: mmap(MAP_POPULATE) of SIZE MiB, then a pattern
written over every page and read back. A SIGSTOP cannot stop it inside the mmap, so a guard
has to keep it from being OOM-killed there (v1: oom_kill_disable; v2: memory.high)."""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time

PAGE = mmap.PAGESIZE


def main() -> int:
    log_path, size_mib = sys.argv[1], int(sys.argv[2])
    size = size_mib << 20
    seed = (os.getpid() * 2654435761 + time.time_ns()) & 0xFFFFFFFF
    with open(log_path, "a", buffering=1) as log:
        log.write(f"start {os.getpid()} {size_mib}\n")
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        log.write("mapped\n")
        pages = size // PAGE
        for page in range(pages):
            struct.pack_into("=QQ", area, page * PAGE, seed, page)
        log.write("written\n")
        for page in range(pages):
            if struct.unpack_from("=QQ", area, page * PAGE) != (seed, page):
                log.write(f"corrupt page {page}\n")
                return 1
        log.write(f"done {pages} pages\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
