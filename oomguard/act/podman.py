"""Podman's checkpoint, for its containers: oomguard does not dump a container's processes
behind its engine's back (podman would find its container gone, and could not restore it).
Podman asks its OCI runtime (runc) to have CRIU dump the container, and exports the result
as one archive, the format CRI-O and checkpointctl share:

    podman container checkpoint --export ARCHIVE --compress zstd CONTAINER
    podman container restore --import ARCHIVE [--name NEW]      (here, or on another node)

The container is stopped by the checkpoint (its memory is free), and kept, exited, by podman.
The archive is written beside its final name and renamed once podman has exited 0 and the
file is on disk: a failed or killed checkpoint leaves no archive that looks whole. The
command runner is injectable (tests); standard library only."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from oomguard.model.atomicfile import fsync_dir
from oomguard.model.errors import OomguardError

Runner = Callable[..., "subprocess.CompletedProcess[str]"]
CHECKPOINT_TIMEOUT = 600.0  # s: a large container's dump under load
PARTIAL = ".partial"


def partial_of(archive: Path) -> Path:
    """Where an archive is written before podman has exited 0 (and where a dead run left it)."""
    return archive.with_name(archive.name + PARTIAL)


def archive_of(partial: Path) -> Path:
    return partial.with_name(partial.name.removesuffix(PARTIAL))


class EngineError(OomguardError):
    """Podman refused, failed, or could not be run."""


class PodmanEngine:
    def __init__(self, command: Sequence[str] = ("podman",), run: Runner = subprocess.run,
                 timeout: float = CHECKPOINT_TIMEOUT) -> None:
        self.command = tuple(command)
        self.run = run
        self.timeout = timeout

    def checkpoint(self, container_id: str, archive: Path) -> None:
        """The container checkpointed by podman into `archive` (0600; its directory should
        be root's alone: the images hold every secret of the container's processes).
        Raises EngineError, with podman's words, and leaves no archive, if it failed."""
        partial = partial_of(archive)
        archive.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Created 0600 before podman writes into it (it keeps the file's mode).
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        try:
            self._call("container", "checkpoint", "--export", str(partial),
                       "--compress", "zstd", container_id)
            os.chmod(partial, 0o600)
            fd = os.open(partial, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(partial, archive)
            fsync_dir(archive.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise

    def restore(self, archive: Path, name: str | None = None) -> str:
        """A container restored from `archive` (under `name`, for a copy beside the old one
        or on another node); returns its id."""
        extra = ("--name", name) if name else ()
        done = self._call("container", "restore", "--import", str(archive), *extra)
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def state(self, container: str) -> tuple[str, bool]:
        """The container's status as podman keeps it ("running", "exited"...) and whether
        its last checkpoint completed (State.Checkpointed). Raises EngineError (no such
        container, no podman)."""
        done = self._call("container", "inspect", "--format",
                          "{{.State.Status}} {{.State.Checkpointed}}", container)
        status, _, checkpointed = done.stdout.strip().partition(" ")
        return status, checkpointed == "true"

    def _call(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [*self.command, *args]
        try:
            done = self.run(argv, capture_output=True, text=True, timeout=self.timeout,
                            check=False, stdin=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            raise EngineError(f"{self.command[0]} is not installed ({exc})") from exc
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"{' '.join(argv[:4])} did not end within "
                              f"{self.timeout:.0f} s") from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout or "").strip()
            raise EngineError(f"{' '.join(argv[:3])} exited with status {done.returncode}: "
                              f"{said[-800:] or 'no message'}")
        return done

