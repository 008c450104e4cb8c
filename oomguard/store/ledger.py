"""A durable record of the trees oomguard has stopped, so a crash never leaves one frozen.

Written before SIGSTOP, cleared when the tree is dumped, thawed or killed (not fsync'd: it
guards against a dead oomguard, not a dead machine, which takes the stopped tasks with it). On
start the daemon thaws whatever is still recorded, after checking each PID still names the same
process (its start time), so a reused PID is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from oomguard.model.atomicfile import write_atomically
from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import ProcReader


@dataclass(frozen=True)
class FrozenEntry:
    pid: int  # 0 for a frozen cgroup (v2 cgroup.freeze)
    starttime: int
    cgroup: str = ""  # the cgroup directory whose cgroup.freeze we set
    owner: int = 0  # the oomguard process that stopped it...
    owner_start: int = 0  # ...and its start time (PIDs are reused)
    # A bystander (held while another task of its cgroup is dumped): that task, and its start
    # time. After a crash it stays held while a CRIU is still at work on that task.
    waits_for: int = 0
    waits_for_start: int = 0


class JsonRecord:
    """The file of a crash record kept whole (the saved limits, the lifts, the OOM shield; the
    frozen ledger is written in place instead, see FrozenLedger._update): read as JSON (None
    from a missing, unreadable or malformed file: nothing recorded), written whole with
    write_atomically (a reader sees the old record or the new one), `sync` and `mode` as its
    owner needs them. Each owner checks the shape of what it reads; a read-change-write holds
    `locked()`."""

    def __init__(self, path: Path, *, sync: bool, mode: int = 0o600) -> None:
        self.path = path
        self.sync = sync
        self.mode = mode
        self._thread_lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held across a read, change and write of the record: a thread lock (this process's
        workers) and an flock on PATH.lock beside it (the daemon and the CLI's processes),
        made root-only with its directory if need be."""
        with self._thread_lock:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(self.path.name + ".lock"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def read(self) -> object:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError):
            return None

    def write(self, data: object) -> None:
        write_atomically(self.path, json.dumps(data), self.mode, sync=self.sync)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _read_all(fd: int) -> bytes:
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _as_json(entry: FrozenEntry) -> dict[str, object]:
    """An entry as written: a bystander's fields only on a bystander's entry."""
    return {k: v for k, v in entry.__dict__.items()
            if v or k not in ("waits_for", "waits_for_start")}


def _parse_entries(text: bytes) -> list[FrozenEntry]:
    """The ledger's entries; none from an empty or unreadable file."""
    try:
        return [FrozenEntry(int(e["pid"]), int(e["starttime"]), str(e.get("cgroup", "")),
                            int(e.get("owner", 0)), int(e.get("owner_start", 0)),
                            int(e.get("waits_for", 0)), int(e.get("waits_for_start", 0)))
                for e in json.loads(text or b"[]")]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


class FrozenLedger:
    """Shared by the daemon and the CLI (each entry names the process that wrote it): recovery
    only touches entries whose owner is dead, and leaves a task that a CRIU of the dead owner
    is still dumping (it is ptrace-attached) until that CRIU is done."""

    def __init__(self, path: Path, proc: ProcReader | None = None,
                 owner: int | None = None) -> None:
        self.path = path
        self.proc = proc or ProcReader()
        self.owner = owner if owner is not None else os.getpid()
        self._owner_start = self.proc.starttime(self.owner)
        self._lock = threading.Lock()
        self._noted: set[int] = set()  # pids this process recorded and has not cleared

    @contextlib.contextmanager
    def _file(self, write: bool = True) -> Iterator[int]:
        """The ledger, open and locked (flock: the daemon and CLI processes share it);
        created for a write."""
        flags = (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            if not write:
                raise
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
            yield fd
        finally:
            os.close(fd)

    def _load(self) -> list[FrozenEntry]:
        try:
            with self._file(write=False) as fd:
                return _parse_entries(_read_all(fd))
        except OSError:
            return []

    def _update(self, change: Callable[[list[FrozenEntry]], list[FrozenEntry]]) -> None:
        """Read, change and write the ledger under its lock, in place: one pwrite of the new
        text padded with spaces to the old length (valid JSON at every moment a process can
        die: there is no half-written file and no rename), then the padding cut off."""
        with self._file() as fd:
            old = _read_all(fd)
            text = json.dumps([_as_json(e) for e in change(_parse_entries(old))]).encode()
            data = text + b" " * max(0, len(old) - len(text))
            # The blocks first: on a full disk a write that grows the file would stop short
            # and leave a half-new ledger (every entry lost); this fails with nothing changed.
            os.posix_fallocate(fd, 0, len(data))
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.EIO, f"short write to {self.path}")
            if len(old) > len(text):
                os.ftruncate(fd, len(text))

    def _mine(self, entry: FrozenEntry) -> bool:
        return (entry.owner == self.owner and entry.owner_start == self._owner_start
                and self._owner_start > 0)

    def record(self, pids: list[int], waits_for: int = 0) -> None:
        """Note the tasks about to be stopped (a stale entry for a reused PID is replaced);
        `waits_for`: they are bystanders held while that task is dumped."""
        fresh = {}
        victim_start = self.proc.starttime(waits_for) if waits_for else 0
        for pid in pids:
            started = self.proc.starttime(pid)  # one read of /proc/PID/stat; 0: gone
            if started:
                fresh[pid] = FrozenEntry(pid, started, "", self.owner, self._owner_start,
                                         waits_for if victim_start else 0, victim_start)
        with self._lock:
            self._update(lambda entries: [e for e in entries if e.cgroup or e.pid not in fresh]
                         + list(fresh.values()))
            self._noted.update(fresh)

    def note(self, pids: list[int]) -> None:
        """record() of those of `pids` this process has not recorded already: a task the
        freeze finds (a fork caught on its way) just before its SIGSTOP. No write for a
        task of the tree recorded before the freeze."""
        new = [pid for pid in pids if pid not in self._noted]
        if new:
            self.record(new)

    def clear(self, pids: list[int]) -> None:
        gone = set(pids)
        with self._lock:
            self._update(lambda entries: [e for e in entries if e.pid not in gone or e.cgroup])
            self._noted.difference_update(gone)

    def record_cgroup(self, directory: Path) -> None:
        entry = FrozenEntry(0, 0, str(directory), self.owner, self._owner_start)
        with self._lock:
            self._update(lambda entries: entries if any(e.cgroup == str(directory)
                                                        for e in entries) else [*entries, entry])

    def clear_cgroup(self, directory: Path) -> None:
        with self._lock:
            self._update(lambda entries: [e for e in entries if e.cgroup != str(directory)])

    def _owner_alive(self, entry: FrozenEntry) -> bool:
        if self._mine(entry):
            return True
        if not (entry.owner > 0 and entry.owner_start > 0
                and self.proc.starttime(entry.owner) == entry.owner_start):
            return False
        try:  # a zombie has ended (an orphan's reaper may take its time)
            return self.proc.state(entry.owner) not in ("Z", "X")
        except ProcessGone:
            return False

    def recorded(self, pids: list[int]) -> list[int]:
        """Those of `pids` the ledger names (as the same process), whoever recorded them: a
        task found stopped that oomguard stopped (a bystander held by a dump, or by the
        standby while no daemon ran), not its user."""
        if not pids:
            return []
        named = {(e.pid, e.starttime) for e in self._load() if not e.cgroup}
        return [pid for pid in pids if (pid, self.proc.starttime(pid)) in named]

    def left_over(self, pids: list[int]) -> list[int]:
        """Those of `pids` the ledger names (as the same process) for an oomguard process that
        is gone: what the last run's standby, or a dead daemon, stopped and left to the next
        daemon to continue."""
        if not pids:
            return []
        wanted = set(pids)
        left = {(e.pid, e.starttime) for e in self._load()
                if not e.cgroup and e.pid in wanted and not self._owner_alive(e)}
        return [pid for pid in pids if (pid, self.proc.starttime(pid)) in left]

    def recover(self, hold_back: Callable[[int], bool] | None = None) -> list[str]:
        """Thaw what dead oomguard processes left stopped: each recorded cgroup, and each task
        that still exists as the same process and is not being dumped right now, nor held back
        by `hold_back(pid)` (the daemon: its cgroup is being acted on). Returns what was
        thawed; entries still pending stay (see `pending`)."""
        thawed: list[str] = []

        def settle(entries: list[FrozenEntry]) -> list[FrozenEntry]:
            keep = []
            for entry in entries:
                if self._owner_alive(entry):
                    keep.append(entry)
                elif entry.cgroup:
                    with contextlib.suppress(OSError):
                        (Path(entry.cgroup) / "cgroup.freeze").write_text("0")
                        thawed.append(entry.cgroup)
                else:
                    try:
                        info = self.proc.process(entry.pid)
                    except ProcessGone:
                        continue
                    if info.starttime != entry.starttime or info.state in ("Z", "X"):
                        continue  # the PID was reused (not ours), or the task is dead
                    if info.tracer_pid or self._still_dumped(entry) or (
                            hold_back is not None and hold_back(entry.pid)):
                        keep.append(entry)  # a CRIU is at work on it (or on the task it
                        continue  # waits for), or its cgroup is being acted on: later
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(entry.pid, signal.SIGCONT)
                        thawed.append(str(entry.pid))
            return keep

        with self._lock:
            self._update(settle)
        return thawed

    def _still_dumped(self, entry: FrozenEntry) -> bool:
        """A bystander's dump is still in progress: the task it waits for is alive, the same
        process, and traced (a dead owner's CRIU still at work on it)."""
        if not entry.waits_for:
            return False
        try:
            victim = self.proc.process(entry.waits_for)
        except ProcessGone:
            return False
        return victim.starttime == entry.waits_for_start and bool(victim.tracer_pid) \
            and victim.state not in ("Z", "X")

    def pending(self) -> bool:
        """Entries left by dead owners that could not be settled yet."""
        return any(not self._owner_alive(e) for e in self._load())

    def held_elsewhere(self) -> bool:
        """Entries of another oomguard process that still lives: a standby told to end that
        has not ended yet, a CLI's checkpoint. Once it is gone they are pending (settled by
        whoever looks next), so a daemon looks again soon rather than at its next rescan."""
        return any(not self._mine(e) and self._owner_alive(e) for e in self._load())


class SavedLimits:
    """The cgroup settings oomguard replaced (v2 memory.high, v1 oom_kill_disable), kept on disk
    so that a restart after a crash puts back the user's value, not the one oomguard set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Not fsync'd: what it guards against is a dead daemon, and the next one reads the page
        # cache. No fsync keeps it off the path between a threshold crossing and SIGSTOP.
        self.record = JsonRecord(path, sync=False)
        self._lock = threading.Lock()  # guards are armed from several threads at once

    def _load(self) -> dict[str, int | None]:
        data = self.record.read()
        if not isinstance(data, dict):
            return {}
        return {str(k): v for k, v in data.items()
                if v is None or (isinstance(v, int) and not isinstance(v, bool))}

    def _save(self, data: dict[str, int | None]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.record.write(data)

    def remember(self, key: str, current: int | None) -> int | None:
        """The original value for `key`: the saved one if oomguard already replaced it."""
        return self.remember_many({key: current})[key]

    def remember_many(self, current: dict[str, int | None]) -> dict[str, int | None]:
        """remember() for many keys in one durable write (a thousand guards arm at once)."""
        with self._lock:
            data = self._load()
            new = {key: value for key, value in current.items() if key not in data}
            if new:
                data.update(new)
                self._save(data)
            return {key: data[key] for key in current}

    def items(self) -> dict[str, int | None]:
        with self._lock:
            return self._load()

    def forget(self, key: str) -> None:
        self.forget_many([key])

    def forget_many(self, keys: Iterable[str]) -> None:
        with self._lock:
            data = self._load()
            dropped = [key for key in keys if data.pop(key, "absent") != "absent"]
            if dropped:
                self._save(data)
