"""Small files written whole: a reader sees the old file or the new one, never a partial one.

One rule for every such file oomguard writes (its ledgers, a checkpoint's meta.json, the CRIU
hook, the units, the metrics' textfile): the new content goes to a temporary file in the same
directory, made anew (O_CREAT|O_EXCL, never through a symlink: O_NOFOLLOW) with the given mode,
fsync'd, renamed over the target, and the directory fsync'd. A write that fails leaves no
temporary file behind and the target as it was.

``sync=False`` leaves out both fsyncs, for the files whose writer must not wait on the disk: the
records written on the path between a threshold crossing and SIGSTOP (they guard against a dead
daemon, and the next one reads the page cache), and the metrics' textfile (regenerated
periodically; an fsync can stall for long on a machine under memory pressure).

At the bottom of the import graph (only ``os``): every layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def temporary_name(path: Path) -> Path:
    """The temporary file a write of `path` goes through: hidden, in the same directory, one per
    process and thread (concurrent writers never share one)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def fsync_dir(path: Path) -> None:
    """A directory's entries durable (a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes | str, mode: int = 0o600, *,
                     sync: bool = True) -> None:
    """Replace `path` with `data` (str is written as UTF-8), the file's mode exactly `mode`
    (whatever the umask). A symlink at the temporary name is removed, never followed; one at
    `path` is replaced, not written through. Raises OSError; no temporary file is left."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = temporary_name(path)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a dead writer with this PID (or a planted symlink)
    fd = os.open(tmp, _FLAGS, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync:
        fsync_dir(path.parent)
