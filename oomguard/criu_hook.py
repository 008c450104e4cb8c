"""CRIU action script: the checkpoint's commit point.

CRIU execs this (through a two-line sh wrapper) for every action. On `post-dump` it makes the
images durable (fdatasync each file and the directory) and drops their page cache
(POSIX_FADV_DONTNEED after the sync; fsync alone does not uncharge the cache from the memory
cgroup). A non-zero exit makes CRIU resume the tree instead of killing it, so a checkpoint that
is not on disk never costs the process its life.

Standard library only: it runs as `python -I criu_hook.py`, outside the package's import path.
"""

from __future__ import annotations

import os
import sys
import time


def _regular_files(directory: str) -> list[str]:
    paths = (os.path.join(directory, name) for name in sorted(os.listdir(directory)))
    return [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]


def sync_and_drop(directory: str) -> tuple[int, float, float]:
    """fdatasync every regular file in `directory` and the directory, then drop their page
    cache; returns (bytes seen, seconds syncing, seconds dropping)."""
    files = _regular_files(directory)
    total = 0
    start = time.monotonic()
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    synced = time.monotonic()
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total, synced - start, time.monotonic() - synced


def main() -> int:
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
        return 0
    directory = os.environ.get("CRTOOLS_IMAGE_DIR")
    if not directory:
        print("oomguard criu hook: CRTOOLS_IMAGE_DIR not set", file=sys.stderr)
        return 1
    try:
        total, sync_s, drop_s = sync_and_drop(directory)
    except OSError as exc:
        print(f"oomguard criu hook: cannot make images durable: {exc}", file=sys.stderr)
        return 1
    # CRIU writes what its action scripts print into dump.log: the benchmarks read this line.
    print(f"oomguard criu hook: {total} bytes, fdatasync {sync_s:.6f} s, "
          f"page cache dropped {drop_s:.6f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
