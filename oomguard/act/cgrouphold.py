"""Holding a paged-out tree in a frozen cgroup of its own (cgroup v2's `cgroup.freeze`), not
with SIGSTOP.

A tree kept stopped with SIGSTOP is a stopped job to its shell: the shell says "Stopped", takes
the terminal back, and its `fg` (or anyone's `kill -CONT`) continues the tree into memory that
is not there. A tree moved into a child cgroup of its own cgroup and frozen there is held by
the kernel instead: its shell is not told (a frozen task is not a stopped job), SIGCONT does
not move it (a `fg` typed meanwhile waits until it is thawed, then the job runs on in the
foreground), and the freeze outlives the daemon (a crash or a restart leaves it held).

The tree is already stopped when it is moved (the freeze step's SIGSTOP: no task can fork
meanwhile); once it is in the frozen cgroup its tasks are continued, which takes them from the
job-control stop into the freezer (only those oomguard stopped are moved: tasks their user had
stopped stay where they were, stopped). The
child cgroup has no controllers of its own, so the tree's memory stays charged to, and limited
by, the cgroup it came from. Released: thawed, each task moved back to that cgroup, and the
child removed.

Only where the whole tree lives in one cgroup v2 cgroup and no task of it is traced (a tracer
holds its tracee in its own stop: such a tree keeps the SIGSTOP hold, with its tracer)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from oomguard.cgroup.base import parse_flat_keyed, parse_procs

HOLD_PREFIX = "oomguard-held-"  # the child cgroup's name: this, then the paged-out tree's id
Kill = Callable[[int, int], None]


class HoldRefused(Exception):
    """The tree cannot be held by a frozen cgroup: why (it keeps the SIGSTOP hold)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def unified_path(text: str) -> str | None:
    """From /proc/PID/cgroup: the cgroup v2 ('0::') path."""
    for line in text.splitlines():
        hier_id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier_id == "0" and controllers == "":
            return path
    return None


class CgroupHold:
    """Holds trees in frozen child cgroups under `mount` (the cgroup v2 hierarchy)."""

    def __init__(self, mount: Path = Path("/sys/fs/cgroup"), *,
                 proc_root: Path = Path("/proc"), kill: Kill = os.kill,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 rmdir: Callable[[Path], None] = os.rmdir) -> None:
        self.mount = mount
        self.rmdir = rmdir
        self.proc_root = proc_root
        self.kill = kill
        self.clock = clock
        self.sleep = sleep

    def where(self, pids: Iterable[int]) -> str:
        """The one cgroup every task is in (relative to the mount, as /proc says it), or why
        the tree cannot be held."""
        places: set[str] = set()
        for pid in pids:
            try:
                text = (self.proc_root / str(pid) / "cgroup").read_text()
                status = (self.proc_root / str(pid) / "status").read_text()
            except OSError as exc:
                raise HoldRefused(f"task {pid}: {exc.strerror or exc}") from exc
            path = unified_path(text)
            if path is None:
                raise HoldRefused(f"task {pid} is in no cgroup v2 cgroup")
            tracer = next((line.split()[1] for line in status.splitlines()
                           if line.startswith("TracerPid:")), "0")
            if tracer != "0":
                raise HoldRefused(f"task {pid} is traced (by {tracer}): its tracer holds it")
            places.add(path)
        if len(places) != 1:
            raise HoldRefused(f"the tree spans {len(places)} cgroups ({', '.join(sorted(places))})")
        return places.pop()

    def planned(self, name: str, pids: list[int]) -> Path:
        """Where `hold` will hold the tree (recorded before it is moved), or HoldRefused."""
        return self.mount / self.where(pids).strip("/") / f"{HOLD_PREFIX}{name}"

    def hold(self, child: Path, pids: list[int], timeout: float) -> None:
        """Moves the tree oomguard stopped (`pids`, parents first) into `child` (planned()),
        frozen, then continues them into the freezer. On any failure everything is undone
        (the tree stopped again, where it was) and HoldRefused says why."""
        try:
            child.mkdir()
        except OSError as exc:
            raise HoldRefused(f"cannot make {child}: {exc.strerror or exc}") from exc
        try:
            (child / "cgroup.freeze").write_text("1")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    self._move(pid, child)
            for pid in pids:  # from the job-control stop straight into the freezer's trap
                with contextlib.suppress(ProcessLookupError):
                    self.kill(pid, signal.SIGCONT)
            if not self._frozen(child, timeout):
                raise HoldRefused(f"{child} did not freeze within {timeout:g} s")
        except (OSError, HoldRefused) as exc:
            self._undo(child, pids)
            if isinstance(exc, HoldRefused):
                raise
            raise HoldRefused(f"cannot hold the tree in {child}: {exc.strerror or exc}") from exc

    def release(self, child: Path) -> list[int]:
        """Thaws the hold, moves its tasks back to the cgroup it is in, removes it. Returns the
        tasks moved back ([] where it is gone already: a crash before it was made)."""
        if not child.name.startswith(HOLD_PREFIX):
            raise ValueError(f"{child} is not a cgroup oomguard holds trees in")
        if not child.is_dir():
            return []
        (child / "cgroup.freeze").write_text("0")
        moved = []
        for pid in parse_procs((child / "cgroup.procs").read_text()):
            with contextlib.suppress(ProcessLookupError):
                self._move(pid, child.parent)
                moved.append(pid)
        self._remove(child)
        return moved

    def _undo(self, child: Path, pids: list[int]) -> None:
        """A hold that failed halfway: every task back where it was, still stopped (SIGSTOP
        again for those continued into the freezer), the child gone."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                self.kill(pid, signal.SIGSTOP)
        with contextlib.suppress(OSError):
            for pid in parse_procs((child / "cgroup.procs").read_text()):
                with contextlib.suppress(OSError):
                    self._move(pid, child.parent)
        with contextlib.suppress(OSError):
            (child / "cgroup.freeze").write_text("0")
        with contextlib.suppress(OSError):
            self._remove(child)

    def _remove(self, child: Path) -> None:
        """rmdir, retried while its last tasks are still on their way out (an exiting task
        leaves cgroup.procs a moment after it is gone from the tree)."""
        deadline = self.clock() + 2.0
        while True:
            try:
                self.rmdir(child)
                return
            except FileNotFoundError:
                return
            except OSError:
                if self.clock() >= deadline:
                    raise
                self.sleep(0.01)

    def _move(self, pid: int, to: Path) -> None:
        try:
            (to / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            if exc.errno == 3:  # ESRCH: the task is gone
                raise ProcessLookupError(pid) from exc
            raise

    def _frozen(self, child: Path, timeout: float) -> bool:
        deadline = self.clock() + timeout
        while parse_flat_keyed((child / "cgroup.events").read_text()).get("frozen", 0) != 1:
            if self.clock() >= deadline:
                return False
            self.sleep(0.002)
        return True
