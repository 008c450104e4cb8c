"""inotify(7) through libc: the kernel says when a watched file changes or a directory gains or
loses an entry. On cgroupfs (v1 and v2 alike, both kernfs) a write to `memory.limit_in_bytes`
or `memory.max` is an IN_MODIFY of that file, removing the cgroup is IN_IGNORED of every watch
in it, and a mkdir/rmdir beneath a watched directory is IN_CREATE/IN_DELETE with IN_ISDIR.

The parser takes bytes; `Inotify` is the thin wrapper around the three system calls."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000

DIR_ENTRIES = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
FILE_CHANGES = IN_MODIFY | IN_DELETE_SELF

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


@dataclass(frozen=True)
class InotifyEvent:
    wd: int  # -1 for IN_Q_OVERFLOW
    mask: int
    name: str  # the entry's name for directory events, "" for the watched file itself

    @property
    def overflow(self) -> bool:
        """Events were lost: whoever relies on them must look again for themselves."""
        return bool(self.mask & IN_Q_OVERFLOW)

    @property
    def gone(self) -> bool:
        """The watched file or directory is gone (the watch ended with it)."""
        return bool(self.mask & (IN_IGNORED | IN_DELETE_SELF))


def parse_events(buffer: bytes) -> list[InotifyEvent]:
    """The events in what one read(2) of an inotify fd returned (a truncated tail is dropped)."""
    events = []
    offset = 0
    while offset + _HEADER.size <= len(buffer):
        wd, mask, _cookie, length = _HEADER.unpack_from(buffer, offset)
        start = offset + _HEADER.size
        if start + length > len(buffer):
            break
        raw = buffer[start:start + length].split(b"\0", 1)[0]
        events.append(InotifyEvent(wd, mask, os.fsdecode(raw)))
        offset = start + length
    return events


class _Libc:
    """The three inotify calls (Python's os module has none), loaded on first use."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


_libc: _Libc | None = None


def _calls() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class Inotify:
    """One non-blocking inotify instance. Raises OSError where inotify is unavailable (ENOSYS,
    EMFILE: the per-user instance limit) and for a path that cannot be watched (ENOENT...)."""

    def __init__(self) -> None:
        self.fd = _check(_calls().init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")

    def fileno(self) -> int:
        return self.fd

    def add(self, path: Path | str, mask: int) -> int:
        """Watch `path`; returns its watch descriptor (the same one again for the same inode:
        the kernel merges the masks only with IN_MASK_ADD, so give the full mask each time)."""
        return _check(_calls().add_watch(self.fd, os.fsencode(path), mask),
                      f"inotify_add_watch {path}")

    def remove(self, wd: int) -> None:
        """Stop a watch; one whose file is gone already is no error."""
        with contextlib.suppress(OSError):
            _check(_calls().rm_watch(self.fd, wd), "inotify_rm_watch")

    def read(self) -> list[InotifyEvent]:
        """Every event queued now (non-blocking; [] when there is none)."""
        events: list[InotifyEvent] = []
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return events
            if not chunk:
                return events
            events += parse_events(chunk)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
