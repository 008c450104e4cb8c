"""What a daemon that died during a podman checkpoint left in the store's `containers/`: an
archive still under its `.partial` name (PodmanEngine.checkpoint renames it only once podman
has exited 0). Podman, left running, may have finished it; or killed with the daemon (systemd
stops the unit's processes), torn it. Looked at by the next daemon before it acts:

- still being written (a process has it open, or names it on its command line: podman dumps
  for a while before it writes there): left, and looked at again later;
- whole zstd frames (oomguard.store.zstdframes) of a container podman says was checkpointed,
  or that podman no longer knows: the checkpoint is kept, under its archive name;
- torn, of a container podman says is not checkpointed (it still runs): nothing of it is
  lost, the torn file is removed;
- anything else (whole but podman says not checkpointed, torn but checkpointed): left as it
  is, and said, for a person to look at. An archive is never removed that could be the only
  copy of a container."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomguard.act.podman import PARTIAL, EngineError, PodmanEngine, archive_of
from oomguard.model.atomicfile import fsync_dir
from oomguard.sense.procfs import ProcReader
from oomguard.store.zstdframes import frames_whole

KEPT, REMOVED, BUSY, LEFT = "kept", "removed", "busy", "left"


@dataclass(frozen=True)
class PartialArchive:
    partial: Path
    outcome: str  # KEPT (renamed to `archive`), REMOVED, BUSY, LEFT
    container: str  # the container id's first 12 characters (the archive's name starts so)
    why: str
    archive: Path | None = None


def container_of(partial: Path) -> str:
    return partial.name.partition("-")[0]


def partials_in(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.name.endswith(PARTIAL))
    except FileNotFoundError:
        return []


def settle_partial(partial: Path, podman: PodmanEngine | None,
                   using: Callable[[Path], list[int]] | None = None,
                   whole: Callable[[Path], bool] = frames_whole) -> PartialArchive:
    """One `.partial` archive looked at (see the module's docstring). Raises nothing but
    OSError from the rename or the removal."""
    container = container_of(partial)
    busy = (using or ProcReader().using)(partial)
    if busy:
        return PartialArchive(partial, BUSY, container,
                              f"process {', '.join(map(str, busy))} is still writing it")
    intact = whole(partial)
    state: tuple[str, bool] | None = None
    said = "podman is not set up here"
    if podman is not None:
        try:
            state = podman.state(container)
        except EngineError as exc:
            said = str(exc)
    if intact and (state is None or state[1]):
        archive = archive_of(partial)
        if archive.exists():
            return PartialArchive(partial, LEFT, container, f"{archive.name} exists already")
        os.chmod(partial, 0o600)
        os.rename(partial, archive)
        fsync_dir(archive.parent)
        why = "podman had finished it" if state is not None else \
            f"whole, and podman cannot say more ({said})"
        return PartialArchive(partial, KEPT, container, why, archive)
    if not intact and state is not None and not state[1]:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        return PartialArchive(partial, REMOVED, container,
                              f"torn, and the container was not checkpointed ({state[0]})")
    what = "whole" if intact else "torn"
    podman_says = f"podman says {state[0]}, checkpointed {state[1]}" if state is not None \
        else said
    return PartialArchive(partial, LEFT, container, f"{what}; {podman_says}")
