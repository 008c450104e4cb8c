"""oomguard's own swap files: where a machine without swap (or without room in it) gets some
for a page-out, made when first needed and removed once nothing paged out needs it.

A swap file lives in a root-only directory (STORE/.swap: the store's file system, under its
budget), is allocated for real (fallocate: no holes, which swapon refuses), and is switched on
without a priority, which the kernel makes lower than every area already on: the machine's
own swap, zram or zswap's are used first. mkswap and swapon/swapoff are util-linux's, run by
the injected command runner.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from oomguard.act.pageout import PageoutError
from oomguard.model.runner import CommandRunner, SubprocessRunner
from oomguard.sense.swaps import SwapArea, SwapReader

MiB = 1 << 20
MIN_SIZE = 16 * MiB  # smaller is not worth an area (mkswap wants at least 10 pages)
PREFIX = "oomguard-swap-"
COMMAND_TIMEOUT = 60.0  # mkswap on a large file, swapoff reading pages back in


class SwapFiles:
    def __init__(self, directory: Path, runner: CommandRunner | None = None,
                 reader: SwapReader | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.runner = runner or SubprocessRunner()
        self.reader = reader or SwapReader()
        self.wall_clock = wall_clock

    def ours(self) -> list[SwapArea]:
        """The swap areas that are oomguard's files in this directory, switched on."""
        mine = str(self.directory.resolve()) + os.sep
        return [a for a in self.reader.areas() if a.kind == "file" and a.path.startswith(mine)
                and Path(a.path).name.startswith(PREFIX)]

    def make(self, size: int) -> Path:
        """A new swap file of at least `size` bytes, switched on. Raises PageoutError (with
        what refused it: no room on the disk, a file system that cannot hold swap files such
        as btrfs without nocow or NFS, swapon not allowed in a container) and leaves nothing
        behind."""
        size = max(MIN_SIZE, -(-size // MiB) * MiB + MiB)  # whole MiB, plus the header's
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        path, fd = self._create()
        try:
            try:
                os.posix_fallocate(fd, 0, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._run(["mkswap", str(path)], f"mkswap {path}")
            self._run(["swapon", str(path)], f"swapon {path}")
        except (OSError, PageoutError) as exc:
            with contextlib.suppress(OSError):
                path.unlink()
            if isinstance(exc, PageoutError):
                raise
            raise PageoutError(f"cannot allocate a {size >> 20} MiB swap file in "
                               f"{self.directory}: {exc}") from exc
        return path

    def _create(self) -> tuple[Path, int]:
        stamp = int(self.wall_clock() * 1000)
        for serial in range(100):
            path = self.directory / f"{PREFIX}{stamp}-{serial}"
            try:
                return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                     0o600)
            except FileExistsError:
                continue
            except OSError as exc:
                raise PageoutError(f"cannot create a swap file in {self.directory}: "
                                   f"{exc}") from exc
        raise PageoutError(f"cannot create a swap file in {self.directory}: 100 names taken")

    def remove(self, path: Path) -> None:
        """Switched off (its pages read back into memory first: the kernel does) and deleted.
        Raises PageoutError if swapoff fails (no room for its pages): the file stays on."""
        if any(area.path == str(path) for area in self.reader.areas()):
            self._run(["swapoff", str(path)], f"swapoff {path}")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def leftovers(self) -> list[Path]:
        """Files of ours that are not switched on (a crash between make's steps, or after a
        swapoff): safe to delete."""
        on = {area.path for area in self.ours()}
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        return [self.directory / n for n in names
                if n.startswith(PREFIX) and str(self.directory.resolve() / n) not in on]

    def _run(self, argv: list[str], what: str) -> None:
        try:
            result = self.runner.run(argv, timeout=COMMAND_TIMEOUT)
        except OSError as exc:  # the program is not there
            raise PageoutError(f"{what}: {exc}") from exc
        if result.timed_out:
            raise PageoutError(f"{what}: no answer within {COMMAND_TIMEOUT:g} s")
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip().splitlines()
            raise PageoutError(f"{what} failed: {said[-1] if said else result.returncode}")
