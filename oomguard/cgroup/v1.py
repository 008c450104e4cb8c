"""cgroup v1 memory controller, read through cgroupspy's MemoryController.

Also the v1 notification mechanism: eventfd thresholds on memory.usage_in_bytes and OOM
notifications on memory.oom_control, both registered through cgroup.event_control
(Documentation/admin-guide/cgroup-v1/memory.rst, sections 9 and 10).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from cgroupspy.controllers import MemoryController

from oomguard.cgroup.base import (
    LimitBusy,
    MemorySnapshot,
    gone_if_removed,
    parse_flat_keyed,
    parse_procs,
    removed,
)
from oomguard.model.errors import CgroupGone

# The kernel reports "no limit" as PAGE_COUNTER_MAX rounded to pages: anything this big is unlimited.
V1_UNLIMITED_FLOOR = 1 << 62
# vmpressure's window (mm/vmpressure.c: SWAP_CLUSTER_MAX * 16 pages scanned): each event of
# register_pressure stands for at most this much reclaimed.
RECLAIM_WINDOW_BYTES = 32 * 16 * 4096


class _Node:
    """The one attribute cgroupspy's controllers need from a tree node: its bytes path."""

    def __init__(self, path: Path) -> None:
        self.full_path = os.fsencode(path)


class V1MemoryCgroup:
    version = 1
    limit_file = "memory.limit_in_bytes"  # written when the limit changes (inotify IN_MODIFY)

    def __init__(self, path: Path | str, mount: Path | str) -> None:
        self.path = Path(path)
        self.mount = Path(mount)
        rel = self.path.relative_to(self.mount).as_posix()
        self.rel_path = "/" if rel == "." else "/" + rel
        self._ctl = MemoryController(_Node(self.path))

    def __repr__(self) -> str:
        return f"V1MemoryCgroup({str(self.path)!r})"

    def exists(self) -> bool:
        return (self.path / "memory.usage_in_bytes").exists()

    def _read(self, name: str) -> str:
        with gone_if_removed(self.path):
            return (self.path / name).read_text()

    def _write(self, name: str, value: str) -> None:
        with gone_if_removed(self.path):
            (self.path / name).write_text(value)

    def _int(self, attribute: str) -> int:
        # cgroupspy raises FileNotFoundError (ENODEV if removed between open and read) for a
        # vanished cgroup, or returns None on some paths.
        with gone_if_removed(self.path):
            value = getattr(self._ctl, attribute)
        if value is None:
            raise CgroupGone(f"cgroup {self.path} is gone")
        return int(value)

    def limit(self) -> int | None:
        value = self._int("limit_in_bytes")
        return None if value >= V1_UNLIMITED_FLOOR else value

    def usage(self) -> int:
        return self._int("usage_in_bytes")

    def stat(self) -> dict[str, int]:
        return parse_flat_keyed(self._read("memory.stat"))

    def oom_control(self) -> dict[str, int]:
        return parse_flat_keyed(self._read("memory.oom_control"))

    def snapshot(self) -> MemorySnapshot:
        usage = self.usage()
        limit = self.limit()
        stat = self.stat()
        oom = self.oom_control()
        return MemorySnapshot(
            usage_bytes=usage,
            limit_bytes=limit,
            # total_* are hierarchical; rss includes transparent huge pages.
            anon_bytes=stat.get("total_rss", stat.get("rss", 0)),
            file_bytes=stat.get("total_cache", stat.get("cache", 0)),
            oom_kills=oom.get("oom_kill", 0),
            under_oom=bool(oom.get("under_oom", 0)),
        )

    def set_limit(self, limit_bytes: int | None) -> None:
        value = "-1" if limit_bytes is None else str(limit_bytes)
        self._write("memory.limit_in_bytes", value)

    def oom_kill_disabled(self) -> bool:
        return bool(self.oom_control().get("oom_kill_disable", 0))

    def set_oom_kill_disable(self, disabled: bool) -> None:
        """memory.oom_control: with 1, a task at the limit waits (in the kernel) instead of
        being OOM-killed, and the cgroup's OOM eventfd fires."""
        self._write("memory.oom_control", "1" if disabled else "0")

    def raise_limit(self, new_limit: int) -> Callable[[], None]:
        """Lift the limit to `new_limit`; returns the undo."""
        old = self.limit()
        self.set_limit(new_limit)
        return lambda: self.set_limit(old)

    def lift_swap(self, need: int) -> Callable[[], None] | None:
        """cgroup v1 counts swap with memory (memory.memsw.*): a page-out moves a page from
        one to the other within the same sum, so there is nothing to lift."""
        return None

    def reclaim(self, amount: int) -> bool:
        """cgroup v1 has no memory.reclaim: False (the caller lowers the limit for a moment,
        recorded: oomguard.act.lifts.LimitLifts.lower)."""
        return False

    def limits_state(self) -> dict[str, int | None]:
        """What raise_limit changes, to be recorded and put back (even by another process)."""
        return {"max": self.limit()}

    def put_back_limits(self, state: dict[str, int | None]) -> None:
        """The kernel reclaims what it can first; with usage still above the limit the write
        fails with EBUSY: LimitBusy."""
        try:
            self.set_limit(state.get("max"))
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise LimitBusy(errno.EBUSY, f"usage {self.usage()} is above the limit "
                                f"{state.get('max')} to put back") from exc
            raise

    def procs(self) -> list[int]:
        return parse_procs(self._read("cgroup.procs"))

    def add_proc(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def child(self, name: str) -> V1MemoryCgroup:
        return V1MemoryCgroup(self.path / name, self.mount)

    def create(self) -> None:
        self.path.mkdir(exist_ok=True)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.rmdir()

    # -- notifications ---------------------------------------------------------------------------

    def register_threshold(self, threshold_bytes: int) -> int:
        """An eventfd that becomes readable whenever usage crosses `threshold_bytes` either way."""
        return self._register("memory.usage_in_bytes", str(threshold_bytes))

    def register_oom(self) -> int:
        """An eventfd that becomes readable when the cgroup enters an OOM episode."""
        return self._register("memory.oom_control", None)

    def register_pressure(self) -> int:
        """An eventfd that counts the kernel's reclaim in this cgroup (and those beneath it):
        one event per window of RECLAIM_WINDOW pages scanned (vmpressure, level "low": any
        reclaim). Nothing while nothing is reclaimed; at the limit, every allocation is."""
        return self._register("memory.pressure_level", "low")

    def _register(self, control_file: str, argument: str | None) -> int:
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            with gone_if_removed(self.path):
                target = os.open(self.path / control_file, os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, CgroupGone):
            os.close(efd)
            raise
        try:
            line = f"{efd} {target}" + (f" {argument}" if argument else "")
            (self.path / "cgroup.event_control").write_text(line)
        except OSError as exc:
            os.close(efd)
            if removed(exc):
                raise CgroupGone(f"cgroup {self.path} is gone") from exc
            raise
        finally:
            # The kernel holds its own reference to the file once registered.
            os.close(target)
        return efd
