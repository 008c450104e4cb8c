"""Lazy restore (`oomguard restore --lazy`): the job runs again at once, whatever its size, and
its memory follows.

CRIU restores the tree with `--lazy-pages`: private anonymous memory (nearly all of a job's) is
not read in but registered with userfaultfd, and a `criu lazy-pages` daemon started first
serves each page the job touches from the images, then streams in the rest behind it; it ends
once every page is in. A keeper process (oomguard/lifecycle/lazykeeper.py), started beside it and outliving
the CLI like the daemon, holds the checkpoint's restore lock meanwhile (no second restore, no
forget, no pruning of images still being read), verifies the pages, and finally drops their
page cache and writes `lazy.json` (when every page was in, what verification found).

Before CRIU starts, the restore warms the page cache with the job's small runs of memory
(oomguard/store/pagemap.py), what it touches first; the bulk is left to the lazy-pages daemon.

What is verified when: every image but the pages before CRIU starts, as for an eager restore;
the pages while they stream in (the keeper reads them ahead of the lazy daemon, which then finds
them in the page cache). A job that touched a damaged page has run with it until the keeper
finds the mismatch; then the keeper kills it and sets the checkpoint back to "checkpointed",
where an eager restore refuses it. An eager restore never runs a damaged checkpoint at all: it
is what the daemon's auto-restore does.

Needs CRIU's `uffd-noncoop` feature (userfaultfd with fork/remap/exit events, kernel >= 4.11);
without it the restore is eager and says why.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from oomguard.act.criu import Criu
from oomguard.lifecycle.lazykeeper import LAZY_STATUS
from oomguard.model.errors import CriuError

LAZY_SOCKET = "lazy-pages.socket"  # CRIU's name, in the work dir
LAZY_PID = "lazy-pages.pid"
LAZY_LOG = "lazy-pages.log"
KEEPER_LOG = "lazy-keeper.log"
LAZY_LOG_LEVEL = 3  # 4 logs every page copied: a line per 4 KiB
# The keepers this process started, reaped as they end. A lazily restored job needs its
# lazy-pages daemon until every page is in: were that daemon killed first, the kernel would
# give the job zero-filled pages where its memory had not come yet (a closed userfaultfd
# unregisters its ranges). The daemon's shutdown waits for them (wait_for_keepers); under
# systemd, its KillMode=mixed would otherwise kill them with the unit.
_KEEPERS: list[subprocess.Popen[bytes]] = []
_KEEPERS_LOCK = threading.Lock()


def running_keepers() -> int:
    """How many of this process's keepers still run (the ended ones are reaped)."""
    with _KEEPERS_LOCK:
        _KEEPERS[:] = [keeper for keeper in _KEEPERS if keeper.poll() is None]
        return len(_KEEPERS)


def wait_for_keepers(timeout: float, clock: Callable[[], float] = time.monotonic) -> int:
    """Until every keeper has ended (each ends once its job's pages are all in) or `timeout`
    passes; returns how many still run."""
    deadline = clock() + timeout
    while running_keepers() and clock() < deadline:
        time.sleep(0.1)
    return running_keepers()


@functools.lru_cache(maxsize=8)
def _probe(binary: str) -> str | None:
    try:
        done = subprocess.run([binary, "check", "--feature", "uffd-noncoop"],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"criu check --feature uffd-noncoop could not run: {exc}"
    if done.returncode == 0:
        return None
    said = (done.stdout + done.stderr).strip().splitlines()
    return ("userfaultfd is not available here (criu check --feature uffd-noncoop: "
            f"{said[-1] if said else f'exit status {done.returncode}'})")


def lazy_unavailable(criu: Criu) -> str | None:
    """Why a lazy restore cannot be done with this CRIU on this kernel; None if it can.
    Asked once per binary and process."""
    return _probe(criu.binary)


def lazy_pages_argv(criu: Criu, images: Path, work_dir: Path) -> list[str]:
    return [criu.binary, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work_dir),
            "--log-file", LAZY_LOG, f"-v{LAZY_LOG_LEVEL}", "--daemon",
            "--pidfile", str(work_dir / LAZY_PID)]


def _clear(path: Path) -> None:
    """What a previous lazy restore left (CRIU opens these following symlinks)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _kill(pid: int | None) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class LazySession:
    """One lazy restore's helpers: the lazy-pages daemon (listening once start() returned) and
    the keeper, which is told the restored root (hand_over) or to give up (abort)."""

    criu: Criu
    images: Path
    work_dir: Path
    keeper: subprocess.Popen[bytes]
    lazy_pid: int

    @classmethod
    def start(cls, criu: Criu, images: Path, work_dir: Path, lock_fd: int) -> LazySession:
        """Start the keeper (it inherits `lock_fd`, the checkpoint's restore lock) and the
        lazy-pages daemon. Raises CriuError if the daemon does not start."""
        for name in (LAZY_SOCKET, LAZY_PID, LAZY_LOG, KEEPER_LOG, LAZY_STATUS):
            _clear(work_dir / name)
        log_fd = os.open(work_dir / KEEPER_LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # Its own session: it outlives the CLI (and a daemon restart) like the job does.
            keeper = subprocess.Popen(
                criu.confined([sys.executable, "-I", "-m", "oomguard.lifecycle.lazykeeper", str(work_dir),
                               str(lock_fd)]),
                stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, pass_fds=(lock_fd,),
                start_new_session=True, close_fds=True)
        finally:
            os.close(log_fd)
        with _KEEPERS_LOCK:
            _KEEPERS.append(keeper)
        running_keepers()
        result = criu.runner.run(criu.confined(lazy_pages_argv(criu, images, work_dir)),
                                 timeout=60)
        lazy_pid = _read_pid(work_dir / LAZY_PID) if result.returncode == 0 else None
        if lazy_pid is None:
            _tell(keeper.stdin, "abort")
            log = (work_dir / LAZY_LOG)
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] \
                if log.is_file() and not log.is_symlink() else []
            raise CriuError(f"criu lazy-pages did not start (exit status {result.returncode})",
                            "\n".join(tail) or result.stderr.strip()[-2000:])
        return cls(criu, images, work_dir, keeper, lazy_pid)

    def hand_over(self, root_pid: int) -> None:
        """CRIU restored the tree (root `root_pid`): the keeper watches it from now on."""
        _tell(self.keeper.stdin, f"go {root_pid} {self.lazy_pid}")

    def abort(self) -> None:
        """CRIU failed: no tree to serve. The lazy daemon goes; the keeper ends."""
        _kill(self.lazy_pid)
        _tell(self.keeper.stdin, f"abort {self.lazy_pid}")


def _tell(pipe: IO[bytes] | None, line: str) -> None:
    if pipe is None:
        return
    with contextlib.suppress(OSError):
        pipe.write(line.encode() + b"\n")
        pipe.flush()
    with contextlib.suppress(OSError):
        pipe.close()


def _read_pid(path: Path) -> int | None:
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
