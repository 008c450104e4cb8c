"""Verifying a checkpoint while CRIU restores it: one pass over the disk, not two.

Before CRIU starts, every image but the pages (the small ones CRIU acts on: files, fds,
mappings, sockets...) is checked against the checksums, and the file list must match: a damaged
or tampered description never reaches CRIU, which opens files as root. The pages-*.img, nearly
all of the bytes, are hashed as CRIU reads them: a thread reads them with RWF_NOWAIT, which
never waits for the disk (it takes what is in the page cache, at most starting the readahead
CRIU would start there anyway), so no second reader competes with CRIU's (with one beside it
on the same file, 1 GiB took 1.8-2.3 s instead of 0.9-1.2 s here), and the hashing follows a
few megabytes behind; once CRIU reads, the thread also asks for the next 64 MiB ahead
(POSIX_FADV_WILLNEED), keeping more reads in flight than CRIU's readahead does. The verdict
goes to CRIU's post-restore action through a gate (oomguard/store/hookgate.py): it is asked once CRIU
has loaded every page and before any restored task has run an instruction (from then on
whatever the cache lost is read outright); anything but "ok" makes the action fail, and CRIU
kills the restored tree (criu/cr-restore.c: a failing post-restore script aborts the restore).
A damaged checkpoint never runs, as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomguard.model.errors import StoreError
from oomguard.store.criu_hook import REPLY_OK, VERIFY_GATE_ENV
from oomguard.store.hookgate import Gate
from oomguard.store.integrity import (
    READ_BLOCK,
    Hasher,
    damaged,
    digest_file,
    hash_block,
    hasher_factory,
    image_files,
    listing_problems,
)

PAGES = re.compile(r"^pages-\d+\.img(\.zst)?$")  # compressed ones are checked as expanded
GATE_NAME = ".verify"  # in the checkpoint directory: BASE.req and BASE.ack
FOLLOW_PAUSE = 0.001  # seconds between looks at the page cache while CRIU reads
# Once CRIU reads, the next AHEAD bytes past the hash's position are asked for
# (POSIX_FADV_WILLNEED, AHEAD_STEP at a time): more reads in flight than CRIU's own readahead
# keeps. On this VM 1 GiB restored in 1.2-1.6 s so, 1.9-2.2 s without.
AHEAD = 64 << 20
AHEAD_STEP = 8 << 20


@dataclass
class _Following:
    name: str
    fd: int
    hasher: Hasher
    size: int
    offset: int = 0
    done: bool = False
    flags: int = os.RWF_NOWAIT
    advised: int = 0


@dataclass(frozen=True)
class VerifyReport:
    problems: tuple[str, ...]  # empty: intact
    upfront_s: float  # everything but the pages, before CRIU started
    pages_s: float  # the pages, while CRIU read them (0 where not finished)
    pages_bytes: int
    finished: bool  # every page was checked (False: stopped early, CRIU had failed)


class RestoreVerifier:
    """`expected`: name -> digest from the checkpoint's sums file (`sums_name`)."""

    def __init__(self, images: Path, algorithm: str, expected: dict[str, str], sums_name: str,
                 *, ahead: int = AHEAD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.images = images
        self.ahead = ahead  # bytes asked for past the hash's position (0: none)
        self.algorithm = algorithm
        self.expected = expected
        self.sums_name = sums_name
        self.clock = clock
        self.gate: Gate | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._upfront_s = 0.0
        self._pages_s = 0.0
        self._pages_bytes = 0
        self._problems: list[str] = []
        self._finished = False
        self._hurry = False

    @property
    def pages_bytes(self) -> int:
        """Bytes of pages checked so far."""
        return self._pages_bytes

    def pages(self) -> list[Path]:
        return [path for path in image_files(self.images) if PAGES.match(path.name)
                and path.name in self.expected]

    def check_upfront(self) -> None:
        """The file list and every image but the pages; raises StoreError naming every
        problem found."""
        start = self.clock()
        problems = listing_problems(self.images, self.expected, self.sums_name)
        present = {path.name for path in image_files(self.images)}
        for name in sorted(set(self.expected) & present):
            # Left in the page cache: CRIU reads them next, and a cold read of a few KiB waits
            # behind the pages' reads (on this VM 0.5 s of CRIU's start went so).
            if not PAGES.match(name) and digest_file(self.images / name, self.algorithm,
                                                     drop_cache=False) != self.expected[name]:
                problems.append(f"{name} checksum mismatch")
        self._upfront_s = self.clock() - start
        if problems:
            raise damaged(problems)

    def start(self, directory: Path) -> None:
        """Begin on the pages, the gate in `directory`. Raises OSError if the gate cannot be
        made."""
        self.gate = Gate(directory, GATE_NAME)
        self._thread = threading.Thread(target=self._run, name="restore-verifier", daemon=True)
        self._thread.start()

    def gate_env(self) -> dict[str, str]:
        """The environment CRIU's action script needs to find the gate."""
        return {VERIFY_GATE_ENV: str(self.gate.base)} if self.gate is not None else {}

    def verdict(self) -> str:
        return REPLY_OK if not self._problems else "damaged: " + "; ".join(self._problems)

    def check_pages(self, stop: Callable[[], bool] = lambda: False) -> list[str]:
        """Read and check every pages file, left in the page cache (whoever restores reads them
        next); returns the problems (none: intact). `stop`: asked between blocks."""
        problems: list[str] = []
        start = self.clock()
        try:
            for path in self.pages():
                digest = digest_file(path, self.algorithm, drop_cache=False, stop=stop)
                if stop():
                    return problems
                if digest != self.expected[path.name]:
                    problems.append(f"{path.name} checksum mismatch")
                self._pages_bytes += path.stat().st_size
            self._finished = True
        except (OSError, StoreError) as exc:
            problems.append(f"pages unreadable: {exc}")
            self._finished = True
        finally:
            self._pages_s = self.clock() - start
        return problems

    def follow_pages(self, stop: Callable[[], bool], hurry: Callable[[], bool]) -> list[str]:
        """Hash the pages from the page cache as CRIU reads them in; once `hurry()` says CRIU
        has read them all, read outright what is not there (the cache lost it). Returns the
        problems (none: intact)."""
        start = self.clock()
        new_hasher = hasher_factory(self.algorithm)
        pending = []
        problems: list[str] = []
        buffer = bytearray(READ_BLOCK)
        view = memoryview(buffer)
        try:
            for path in self.pages():
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                pending.append(_Following(path.name, fd, new_hasher(), os.fstat(fd).st_size))
            while pending and not stop():
                moved = False
                for item in pending:
                    if self.ahead and item.offset \
                            and item.advised < min(item.offset + self.ahead, item.size):
                        os.posix_fadvise(item.fd, item.advised, AHEAD_STEP,
                                         os.POSIX_FADV_WILLNEED)
                        item.advised += AHEAD_STEP
                    try:
                        count = hash_block(item.fd, item.hasher, view, item.offset, item.size,
                                           item.flags)
                    except BlockingIOError:  # not in the page cache (yet)
                        continue
                    except OSError as exc:
                        if exc.errno != errno.EOPNOTSUPP or not item.flags:
                            raise
                        item.flags = 0  # tmpfs and the like: no RWF_NOWAIT, all in memory
                        continue
                    if count:
                        item.offset += count
                        self._pages_bytes += count
                        moved = True
                    if item.offset >= item.size or not count:
                        if item.hasher.hexdigest() != self.expected[item.name]:
                            problems.append(f"{item.name} checksum mismatch")
                        item.done = True
                        # Closed now: an fd kept open would keep a pruned checkpoint's pages
                        # on the disk for as long as the daemon runs.
                        os.close(item.fd)
                pending = [item for item in pending if not item.done]
                if not moved and pending:
                    if hurry():
                        self._read_outright(pending[0], view)
                    else:
                        time.sleep(FOLLOW_PAUSE)
            self._finished = not pending
        except OSError as exc:
            problems.append(f"pages unreadable: {exc}")
            self._finished = True
        finally:
            for item in pending:
                with contextlib.suppress(OSError):
                    os.close(item.fd)
            self._pages_s = self.clock() - start
        return sorted(problems)

    def _read_outright(self, item: _Following, view: memoryview) -> None:
        count = hash_block(item.fd, item.hasher, view, item.offset, item.size)
        item.offset += count
        self._pages_bytes += count
        if not count:
            item.size = item.offset  # shorter than it was: the digest will say so

    def _hurried(self) -> bool:
        """CRIU's post-restore action has asked for the verdict: it has read every page."""
        if not self._hurry and self.gate is not None and self.gate.request(0.0) is not None:
            self._hurry = True
        return self._hurry

    def _run(self) -> None:
        try:
            self._problems = self.follow_pages(self._stop.is_set, self._hurried)
        except Exception as exc:  # never "ok" for pages that were not all checked
            self._problems = [f"pages not verified: {type(exc).__name__}: {exc}"]
        finally:
            if self.gate is not None and not self._stop.is_set():
                self.gate.reply(self.verdict())

    def finish(self, *, cancel: bool = False) -> VerifyReport:
        """Wait for the pages (or, with `cancel`, stop reading them: CRIU has failed); the
        gate goes."""
        if cancel:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.gate is not None:
            self.gate.close()
        return VerifyReport(tuple(self._problems), self._upfront_s, self._pages_s,
                            self._pages_bytes, self._finished)

    def damage(self, report: VerifyReport) -> StoreError:
        return damaged(list(report.problems))
