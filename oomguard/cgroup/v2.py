"""cgroup v2 memory controller: the small layer of our own (cgroupspy models v1 only)."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

from oomguard.cgroup.base import (
    LimitBusy,
    MemorySnapshot,
    gone_if_removed,
    parse_flat_keyed,
    parse_procs,
)


def parse_max(text: str) -> int | None:
    """memory.max / memory.high: 'max' or a byte count."""
    value = text.strip()
    return None if value == "max" else int(value)


class V2MemoryCgroup:
    version = 2
    limit_file = "memory.max"  # written when the limit changes (inotify IN_MODIFY)

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
        with gone_if_removed(self.path):
            return (self.path / name).read_text()

    def _write(self, name: str, value: str) -> None:
        with gone_if_removed(self.path):
            (self.path / name).write_text(value)

    def limit(self) -> int | None:
        return parse_max(self._read("memory.max"))

    def high(self) -> int | None:
        return parse_max(self._read("memory.high"))

    def events(self) -> dict[str, int]:
        return parse_flat_keyed(self._read("memory.events"))

    def usage(self) -> int:
        return int(self._read("memory.current"))

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
            high_events=events.get("high", 0),
            max_events=events.get("max", 0),
        )

    def set_limit(self, limit_bytes: int | None) -> None:
        self._write("memory.max", "max" if limit_bytes is None else str(limit_bytes))

    def set_high(self, high_bytes: int | None) -> None:
        self._write("memory.high", "max" if high_bytes is None else str(high_bytes))

    def raise_limit(self, new_limit: int) -> Callable[[], None]:
        """Lift memory.max (and memory.high, which would throttle the dump) to `new_limit`;
        returns the undo."""
        old_max, old_high = self.limit(), self.high()
        if old_high is not None and old_high < new_limit:
            self.set_high(new_limit)
        self.set_limit(new_limit)

        def undo() -> None:
            self.set_limit(old_max)
            self.set_high(old_high)
        return undo

    def limits_state(self) -> dict[str, int | None]:
        """What raise_limit changes, to be recorded and put back (even by another process)."""
        return {"max": self.limit(), "high": self.high()}

    def lift_swap(self, need: int) -> Callable[[], None] | None:
        """Room for `need` more bytes in swap under memory.swap.max (a unit's MemorySwapMax=):
        lifted where there is less, for a page-out; returns the undo (None: nothing lifted).
        Putting it back below what is in swap then only keeps more from being swapped: the
        kernel swaps nothing in for it."""
        try:
            limit = parse_max(self._read("memory.swap.max"))
            current = int(self._read("memory.swap.current"))
        except FileNotFoundError:  # no swap accounting here
            return None
        if limit is None or limit - current >= need:
            return None
        self._write("memory.swap.max", str(current + need))
        return lambda: self._write("memory.swap.max", str(limit))

    def reclaim(self, amount: int) -> bool:
        """memory.reclaim (Linux >= 5.19): the kernel reclaims about `amount` bytes of the
        cgroup now, the coldest first. True where it could be asked (EAGAIN: it reclaimed less
        than asked, which is no error here); False on a kernel without it."""
        try:
            self._write("memory.reclaim", str(max(amount, 0)))
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
        return True

    def put_back_limits(self, state: dict[str, int | None]) -> None:
        """memory.max written below usage would make the kernel OOM-kill in the cgroup: reclaim
        first (memory.reclaim), and with usage still above it raise LimitBusy instead."""
        limit = state.get("max")
        usage = int(self._read("memory.current"))
        if limit is not None and usage > limit:
            with contextlib.suppress(OSError):
                self._write("memory.reclaim", str(usage - limit))
            usage = int(self._read("memory.current"))
            if usage > limit:
                raise LimitBusy(errno.EBUSY, f"usage {usage} is above the limit {limit} to "
                                "put back")
        self.set_limit(limit)
        self.set_high(state.get("high"))

    # -- freezer (cgroup.freeze / cgroup.events) ---------------------------------------------------

    def freeze(self) -> None:
        self._write("cgroup.freeze", "1")

    def thaw(self) -> None:
        self._write("cgroup.freeze", "0")

    def is_frozen(self) -> bool:
        return parse_flat_keyed(self._read("cgroup.events")).get("frozen", 0) == 1

    def wait_frozen(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> bool:
        """True once cgroup.events says `frozen 1` (every task parked in the freezer)."""
        deadline = clock() + timeout
        while not self.is_frozen():
            if clock() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    # -- notifications -------------------------------------------------------------------------------

    def open_events_watch(self) -> int:
        """An fd on memory.events that polls POLLPRI when a counter changes (kernfs notify).
        After each wake-up it must be re-read (`rearm_watch`) or it stays ready."""
        with gone_if_removed(self.path):
            fd = os.open(self.path / "memory.events", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        rearm_watch(fd)
        return fd

    def open_psi_trigger(self, trigger: str) -> int:
        from oomguard.sense.psi import open_trigger

        return open_trigger(self.path / "memory.pressure", trigger)


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


def rearm_watch(fd: int) -> None:
    """Re-read a kernfs file so its poll state is reset."""
    os.lseek(fd, 0, os.SEEK_SET)
    with contextlib.suppress(OSError):
        os.read(fd, 4096)
