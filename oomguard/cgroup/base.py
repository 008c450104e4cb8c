"""What every memory cgroup looks like to oomguard, whatever the cgroup version."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from oomguard.model.errors import CgroupGone


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a memory cgroup."""

    usage_bytes: int  # includes page cache
    limit_bytes: int | None  # None: unlimited
    anon_bytes: int  # resident anonymous memory (what a checkpoint frees)
    file_bytes: int  # page cache
    oom_kills: int  # kernel OOM kills counted for this cgroup
    under_oom: bool
    high_events: int = 0  # v2 memory.events: times memory.high throttled the cgroup
    max_events: int = 0  # v2 memory.events: times usage hit memory.max

    @property
    def usage_fraction(self) -> float | None:
        if not self.limit_bytes:
            return None
        return self.usage_bytes / self.limit_bytes

    @property
    def unreclaimable_bytes(self) -> int:
        """What the kernel cannot free by dropping page cache: anonymous memory plus the
        cgroup's kernel memory (page tables, stacks, slab), all in usage but not in `anon`."""
        return max(self.anon_bytes, self.usage_bytes - self.file_bytes)

    @property
    def anon_fraction(self) -> float | None:
        if not self.limit_bytes:
            return None
        return self.anon_bytes / self.limit_bytes


class LimitBusy(OSError):
    """A limit cannot be put back: the cgroup uses more than it (and reclaim did not help)."""


class MemoryCgroup(Protocol):
    """A memory cgroup: v1 (`memory` hierarchy) or v2 (unified, memory controller enabled)."""

    version: int
    limit_file: str  # the file holding the limit (memory.limit_in_bytes, memory.max)
    path: Path  # directory in the cgroup filesystem
    mount: Path  # where its hierarchy is mounted
    rel_path: str  # path inside its hierarchy, '/'-rooted (what /proc/PID/cgroup shows)

    def exists(self) -> bool: ...

    def snapshot(self) -> MemorySnapshot: ...

    def usage(self) -> int: ...

    def limit(self) -> int | None: ...

    def set_limit(self, limit_bytes: int | None) -> None: ...

    def raise_limit(self, new_limit: int) -> Callable[[], None]: ...

    def reclaim(self, amount: int) -> bool: ...

    def lift_swap(self, need: int) -> Callable[[], None] | None: ...

    def limits_state(self) -> dict[str, int | None]: ...

    def put_back_limits(self, state: dict[str, int | None]) -> None: ...

    def procs(self) -> list[int]: ...

    def add_proc(self, pid: int) -> None: ...

    def child(self, name: str) -> MemoryCgroup: ...

    def create(self) -> None: ...

    def remove(self) -> None: ...


class FreezableCgroup(Protocol):
    """A cgroup the whole of which can be frozen at once (v2's cgroup.freeze): what the action
    worker needs of one, whatever the backend (cgroup/watch.freezable says which can)."""

    path: Path

    def freeze(self) -> None: ...

    def thaw(self) -> None: ...

    def wait_frozen(self, timeout: float) -> bool: ...


def removed(exc: OSError) -> bool:
    """Whether an error on a cgroup file means the cgroup was removed: ENOENT when the path was
    looked up after the rmdir, ENODEV when the file was opened before it and read after."""
    return exc.errno in (errno.ENOENT, errno.ENODEV)


@contextlib.contextmanager
def gone_if_removed(path: Path) -> Iterator[None]:
    """Turns the errors of a removed cgroup into CgroupGone; other OSErrors pass through."""
    try:
        yield
    except OSError as exc:
        if removed(exc):
            raise CgroupGone(f"cgroup {path} is gone") from exc
        raise


def subtree_procs(path: Path) -> list[int]:
    """The processes of a cgroup and of every cgroup beneath it (a Slurm job's or a systemd
    slice's live in leaves; a limit set higher up covers them all). Raises CgroupGone if the
    cgroup itself is gone; a child removed meanwhile is skipped."""
    pids: list[int] = []
    for directory, _dirs, files in os.walk(path):
        if "cgroup.procs" not in files:
            continue
        try:
            text = Path(directory, "cgroup.procs").read_text()
        except OSError as exc:
            if removed(exc) and Path(directory) == path:
                raise CgroupGone(f"cgroup {path} is gone") from None
            continue
        pids += [int(x) for x in text.split()]
    if not pids and not path.exists():
        raise CgroupGone(f"cgroup {path} is gone")
    return pids


def read_int_file(path: Path) -> int:
    return int(path.read_text().strip())


def parse_flat_keyed(text: str) -> dict[str, int]:
    """'key value' lines (memory.stat, memory.events, memory.oom_control) -> dict."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if not key or not value:
            continue
        try:
            values[key] = int(value.strip())
        except ValueError:
            continue
    return values


def parse_procs(text: str) -> list[int]:
    return [int(line) for line in text.split()]
