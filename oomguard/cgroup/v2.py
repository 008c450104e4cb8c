"""cgroup v2 memory controller: the small layer of our own (cgroupspy models v1 only)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from oomguard.cgroup.base import MemorySnapshot, parse_flat_keyed, parse_procs
from oomguard.errors import CgroupGone


def parse_max(text: str) -> int | None:
    """memory.max / memory.high: 'max' or a byte count."""
    value = text.strip()
    return None if value == "max" else int(value)


class V2MemoryCgroup:
    version = 2

    def __init__(self, path: Path | str, mount: Path | str) -> None:
        self.path = Path(path)
        self.mount = Path(mount)
        rel = self.path.relative_to(self.mount).as_posix()
        self.rel_path = "/" if rel == "." else "/" + rel

    def __repr__(self) -> str:
        return f"V2MemoryCgroup({str(self.path)!r})"

    def exists(self) -> bool:
        return (self.path / "memory.current").exists()

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except FileNotFoundError as exc:
            raise CgroupGone(f"cgroup {self.path} is gone") from exc

    def _write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except FileNotFoundError as exc:
            raise CgroupGone(f"cgroup {self.path} is gone") from exc

    def limit(self) -> int | None:
        return parse_max(self._read("memory.max"))

    def high(self) -> int | None:
        return parse_max(self._read("memory.high"))

    def events(self) -> dict[str, int]:
        return parse_flat_keyed(self._read("memory.events"))

    def snapshot(self) -> MemorySnapshot:
        stat = parse_flat_keyed(self._read("memory.stat"))
        events = self.events()
        return MemorySnapshot(
            usage_bytes=int(self._read("memory.current")),
            limit_bytes=self.limit(),
            anon_bytes=stat.get("anon", 0),
            file_bytes=stat.get("file", 0),
            oom_kills=events.get("oom_kill", 0),
            under_oom=False,
        )

    def set_limit(self, limit_bytes: int | None) -> None:
        self._write("memory.max", "max" if limit_bytes is None else str(limit_bytes))

    def procs(self) -> list[int]:
        return parse_procs(self._read("cgroup.procs"))

    def add_proc(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def child(self, name: str) -> V2MemoryCgroup:
        return V2MemoryCgroup(self.path / name, self.mount)

    def create(self) -> None:
        self.path.mkdir(exist_ok=True)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.rmdir()
