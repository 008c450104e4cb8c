"""Verifying a checkpoint while CRIU restores it: one pass over the disk, not two.

Before CRIU starts, every image but the pages (the small ones CRIU acts on: files, fds,
mappings, sockets...) is checked against the checksums, and the file list must match: a damaged
or tampered description never reaches CRIU, which opens files as root. The pages-*.img, nearly
all of the bytes, are read by a thread in parallel with CRIU's own reads of them, so that each
block comes off the disk once (whoever reads first, the other finds it in the page cache). The
verdict goes to CRIU's post-restore action through a gate (oomguard/hookgate.py): it is asked
once CRIU has loaded every page and before any restored task has run an instruction; anything
but "ok" makes the action fail, and CRIU kills the restored tree (criu/cr-restore.c: a failing
post-restore script aborts the restore). A damaged checkpoint never runs, as before.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomguard.criu_hook import REPLY_OK, VERIFY_GATE_ENV
from oomguard.errors import StoreError
from oomguard.hookgate import Gate
from oomguard.integrity import damaged, digest_file, image_files, listing_problems

PAGES = re.compile(r"^pages-\d+\.img$")
GATE_NAME = ".verify"  # in the checkpoint directory: BASE.req and BASE.ack


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
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.images = images
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

    def _run(self) -> None:
        start = self.clock()
        try:
            for path in self.pages():
                if self._stop.is_set():
                    return
                # Left in the page cache: CRIU reads these pages now (the restore drops the
                # cache once the tree runs).
                digest = digest_file(path, self.algorithm, drop_cache=False,
                                     stop=self._stop.is_set)
                if self._stop.is_set():
                    return
                if digest != self.expected[path.name]:
                    self._problems.append(f"{path.name} checksum mismatch")
                self._pages_bytes += path.stat().st_size
            self._finished = True
        except (OSError, StoreError) as exc:
            self._problems.append(f"pages unreadable: {exc}")
            self._finished = True
        finally:
            self._pages_s = self.clock() - start
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
