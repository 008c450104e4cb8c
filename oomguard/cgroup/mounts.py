"""Where the memory controller lives: cgroup v1, v2, or a hybrid host (v1 memory + v2 tree)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup


@dataclass(frozen=True)
class MountEntry:
    mount_point: Path
    fstype: str
    super_options: tuple[str, ...]


@dataclass(frozen=True)
class CgroupLayout:
    memory_v1: Path | None  # mount point of the v1 hierarchy holding the memory controller
    unified: Path | None  # mount point of the cgroup2 tree
    unified_controllers: tuple[str, ...]  # controllers available in the cgroup2 root

    @property
    def unified_has_memory(self) -> bool:
        return "memory" in self.unified_controllers

    @property
    def mode(self) -> str:
        """'v1', 'v2', 'hybrid' (v1 memory controller beside a v2 tree) or 'none'."""
        if self.memory_v1 is not None:
            return "hybrid" if self.unified is not None else "v1"
        if self.unified is not None and self.unified_has_memory:
            return "v2"
        return "none"

    @property
    def memory_version(self) -> int | None:
        if self.memory_v1 is not None:
            return 1
        if self.unified is not None and self.unified_has_memory:
            return 2
        return None

    @property
    def memory_mount(self) -> Path | None:
        return self.memory_v1 if self.memory_v1 is not None else (
            self.unified if self.unified_has_memory else None)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        tail = right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        entries.append(MountEntry(
            mount_point=Path(_unescape(fields[4])),
            fstype=tail[0],
            super_options=tuple(tail[2].split(",")),
        ))
    return entries


def layout_from_mounts(entries: list[MountEntry], unified_controllers: tuple[str, ...]) -> CgroupLayout:
    memory_v1 = None
    unified = None
    for entry in entries:
        if entry.fstype == "cgroup" and "memory" in entry.super_options and memory_v1 is None:
            memory_v1 = entry.mount_point
        elif entry.fstype == "cgroup2" and unified is None:
            unified = entry.mount_point
    return CgroupLayout(memory_v1=memory_v1, unified=unified,
                        unified_controllers=unified_controllers if unified else ())


def read_layout(proc_root: Path | str = "/proc") -> CgroupLayout:
    entries = parse_mountinfo((Path(proc_root) / "self" / "mountinfo").read_text())
    unified = next((e.mount_point for e in entries if e.fstype == "cgroup2"), None)
    controllers: tuple[str, ...] = ()
    if unified is not None:
        try:
            controllers = tuple((unified / "cgroup.controllers").read_text().split())
        except OSError:
            controllers = ()
    return layout_from_mounts(entries, controllers)


def open_cgroup(path: str | Path, layout: CgroupLayout) -> MemoryCgroup:
    """A memory cgroup from a filesystem path (/sys/fs/cgroup/memory/jobs) or a hierarchy path
    (/jobs). Raises ValueError when the path is in no memory hierarchy."""
    mount = layout.memory_mount
    if mount is None:
        raise ValueError("this machine has no memory cgroup controller mounted")
    candidate = Path(path)
    if not candidate.is_absolute():
        raise ValueError(f"cgroup path must be absolute: {path}")
    if ".." in candidate.parts:
        raise ValueError(f"cgroup path may not contain '..': {path}")
    if not candidate.is_relative_to(mount):
        candidate = mount / str(candidate).lstrip("/")
    if layout.memory_version == 1:
        return V1MemoryCgroup(candidate, mount)
    return V2MemoryCgroup(candidate, mount)
