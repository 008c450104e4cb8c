"""Page a stopped process's memory out of RAM: process_madvise(2) with MADV_PAGEOUT over its
private mappings, through a pidfd (Linux >= 5.10; CAP_SYS_NICE and ptrace rights over it).

The kernel reclaims the pages now, into swap for anonymous memory (so swap must have room:
oomguard.act.swapfiles), and the process takes them back as it touches them. Only pages that
this process alone maps are paged out (a page shared with a fork's copy stays), and a locked
range (mlock) is skipped by the kernel: `PageoutResult` says how much was asked and what was
skipped. The page-out of a process that is not stopped is refused: it would fault its pages
straight back in.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from oomguard.model.errors import OomguardError, ProcessGone
from oomguard.sense.procfs import ProcReader

SYS_PROCESS_MADVISE = 440  # the same number on every architecture (the unified table, 5.10)
MADV_PAGEOUT = 21
UIO_MAXIOV = 1024  # iovecs per call
# Mappings never paged out: the kernel's own (their pages are not the process's memory).
SPECIAL = frozenset({"[vsyscall]", "[vvar]", "[vvar_vclock]", "[vdso]", "[uprobes]"})
_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


class PageoutError(OomguardError):
    """The page-out cannot be done at all (no kernel support, no rights): `reason` says why,
    for the event that names the next step."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    name: str

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PageoutResult:
    pid: int
    ranges: int  # mappings asked for
    advised_bytes: int  # of their length, what the kernel took the advice for
    skipped: int  # ranges it refused (locked, special), passed over


def parse_maps(text: str) -> list[Mapping]:
    """/proc/PID/maps lines into mappings; malformed lines are passed over (a name may hold
    anything, even spaces: it is the rest of the line)."""
    found = []
    for line in text.splitlines():
        match = _MAPS_LINE.match(line)
        if match is None:
            continue
        start, end = int(match.group(1), 16), int(match.group(2), 16)
        if end > start:
            found.append(Mapping(start, end, match.group(3), match.group(4).strip()))
    return found


def pageout_ranges(mappings: Sequence[Mapping]) -> list[Mapping]:
    """The mappings worth paging out: private ones (anonymous memory, the heap, stacks, a
    file's private copy-on-write pages), not shared ones (page cache others may use) nor the
    kernel's special ones."""
    return [m for m in mappings if m.perms[3:4] == "p" and m.name not in SPECIAL]


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class ProcessPager:
    """MADV_PAGEOUT over every private mapping of one stopped process. `proc_root`: where
    /proc is (tests point it elsewhere for the parser's sake; the syscall is always real)."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self.proc = ProcReader(proc_root)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long

    def page_out(self, pid: int) -> PageoutResult:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError as exc:
            raise ProcessGone(f"process {pid} is gone") from exc
        try:
            running = [s for s in self.proc.thread_states(pid) if s not in ("T", "t")]
            if running:
                raise PageoutError(f"process {pid} is not stopped (a thread in state "
                                   f"{running[0]}): its pages would come straight back")
            try:
                maps = (self.proc_root / str(pid) / "maps").read_text(errors="replace")
            except (FileNotFoundError, ProcessLookupError) as exc:
                raise ProcessGone(f"process {pid} is gone") from exc
            ranges = pageout_ranges(parse_maps(maps))
            advised = skipped = 0
            for batch in _batches(ranges, UIO_MAXIOV):
                done, passed = self._advise(pidfd, pid, batch)
                advised += done
                skipped += passed
            return PageoutResult(pid, len(ranges), advised, skipped)
        finally:
            os.close(pidfd)

    def _advise(self, pidfd: int, pid: int, batch: list[Mapping]) -> tuple[int, int]:
        """One process_madvise call per batch; a partial answer goes on after what it did,
        and a range the kernel refuses (EINVAL: locked, a PFN map) is passed over."""
        advised = skipped = 0
        pending = [(m.start, m.length) for m in batch]
        while pending:
            vec = (_IoVec * len(pending))(*[_IoVec(start, length) for start, length in pending])
            got = self._libc.syscall(ctypes.c_long(SYS_PROCESS_MADVISE), ctypes.c_long(pidfd),
                                     vec, ctypes.c_long(len(pending)),
                                     ctypes.c_long(MADV_PAGEOUT), ctypes.c_long(0))
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINVAL:  # the first range refused: pass over it
                    skipped += 1
                    pending = pending[1:]
                    continue
                if err == errno.ESRCH:
                    raise ProcessGone(f"process {pid} is gone")
                if err == errno.ENOSYS:
                    raise PageoutError("this kernel has no process_madvise (Linux >= 5.10)")
                if err == errno.EPERM:
                    raise PageoutError(f"no right to page out process {pid} (needs "
                                       "CAP_SYS_NICE and ptrace access to it)")
                if err == errno.ENOMEM and advised:  # nothing more to take: swap is full
                    break
                raise PageoutError(f"process_madvise on process {pid}: "
                                   f"{os.strerror(err)}")
            if got == 0:  # nothing taken (never seen): do not ask again
                break
            advised += got
            pending = _after(pending, got)
        return advised, skipped


def _batches(ranges: list[Mapping], size: int) -> Iterator[list[Mapping]]:
    for index in range(0, len(ranges), size):
        yield ranges[index:index + size]


def _after(pending: list[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    """The ranges left once `done` bytes of them, from the first on, were advised."""
    rest = []
    for start, length in pending:
        if done >= length:
            done -= length
            continue
        rest.append((start + done, length - done))
        done = 0
    return rest
