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


def sync_and_drop(directory: str) -> int:
    """fdatasync + drop the page cache of every regular file in `directory`; returns bytes seen."""
    total = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return total


def main() -> int:
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
        return 0
    directory = os.environ.get("CRTOOLS_IMAGE_DIR")
    if not directory:
        print("oomguard criu hook: CRTOOLS_IMAGE_DIR not set", file=sys.stderr)
        return 1
    try:
        sync_and_drop(directory)
    except OSError as exc:
        print(f"oomguard criu hook: cannot make images durable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
