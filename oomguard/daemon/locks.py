"""One daemon per store and one per guarded cgroup: locks held for the daemon's life.

Two daemons on one store race on its ledger and its checkpoints; two daemons on one cgroup
undo each other's settings (the second "puts back" the first's oom_kill_disable under it)
and run two CRIUs on one victim. So `oomguard run` takes, before it touches anything:

- the store's lock, `STORE/.daemon.lock`; for a store that other nodes share (NFS...: see
  oomguard.store.nodestate), one daemon per store *per node*: the lock goes into this node's
  state directory, and a second one into LOCK_DIR named by a hash of the store's path, so
  that two daemons of one node meet even with different state directories;
- a lock per guarded cgroup, in LOCK_DIR (/run/oomguard/locks), named by a hash of the
  cgroup's full path (a pattern: of the pattern as written, made absolute), so that two
  daemons with *different* stores still meet there; a system-wide rule takes the lock
  named "system". /run is per boot, as the locks are.

Each is an flock(2) on a file that holds the holder's PID: the kernel lets it go when the
daemon dies, however it dies, so a crash never leaves a stale lock. A lock file is removed
when its holder lets go; a taker checks that the file it locked is still the one at the
path (else it locked a removed file, and tries again).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.config.schema import DaemonConfig
from oomguard.model.errors import OomguardError
from oomguard.store.names import STORE_LOCK

LOCK_DIR = Path("/run/oomguard/locks")
PID_WAIT = 0.5  # a holder that has just taken its lock writes its PID within this long


class LockHeld(OomguardError):
    """Another daemon holds a lock this one needs."""

    def __init__(self, what: str, path: Path, pid: int | None) -> None:
        self.what, self.path, self.pid = what, path, pid
        holder = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"another oomguard daemon ({holder}) already guards {what} "
                         f"(lock {path}): not starting a second one")


@dataclass
class HeldLock:
    path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()  # still held: no taker can lock this file after it goes
        os.close(self.fd)


def _holder(path: Path) -> int | None:
    deadline = time.monotonic() + PID_WAIT
    while True:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().split()[0])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def take_lock(path: Path, what: str) -> HeldLock:
    """Lock `path` (made if missing) for this process, its PID written in it; LockHeld naming
    the holder's PID if another has it. Never waits for the holder."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise LockHeld(what, path, _holder(path)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it as it let go: lock the one at the path now
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{what}\n".encode(), 0)
        return HeldLock(path, fd)


def cgroup_keys(config: DaemonConfig, layout: CgroupLayout) -> dict[str, str]:
    """What each guard rule guards, as lock keys: the cgroup's full path (a pattern as
    written, made absolute under the memory mount), or "system"."""
    keys: dict[str, str] = {}
    for guard in config.guards:
        if guard.system:
            keys["system"] = "the system-wide rule"
        for path in guard.cgroups:
            try:
                full = str(open_cgroup(path, layout).path)
            except ValueError:
                full = path  # refused by the config's checks before this
            keys[full] = f"pattern {full}" if glob.has_magic(full) else f"cgroup {full}"
    return keys


def _key_path(lock_dir: Path, key: str) -> Path:
    if key == "system":
        return lock_dir / "system.lock"
    return lock_dir / f"cgroup-{hashlib.sha256(key.encode()).hexdigest()[:32]}.lock"


@dataclass
class DaemonLocks:
    """The store's lock and the guarded cgroups' locks of one daemon."""

    lock_dir: Path = LOCK_DIR
    store: HeldLock | None = None
    node_store: HeldLock | None = None  # a shared store's lock on this node (LOCK_DIR)
    cgroups: dict[str, HeldLock] = field(default_factory=dict)

    def take_store(self, store: Path, state: Path | None = None) -> None:
        """`state`: this node's state directory, where that is not the store (a shared one)."""
        if state is not None and state != store:
            self.lock_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            digest = hashlib.sha256(os.path.abspath(store).encode()).hexdigest()[:32]
            self.node_store = take_lock(self.lock_dir / f"store-{digest}.lock",
                                        f"store {store} on this node")
            store = state
        store.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.store = take_lock(store / STORE_LOCK, f"store {store}")

    def take_cgroups(self, keys: dict[str, str]) -> None:
        """Hold exactly the locks of `keys` (a reload's new rules): new ones are taken, those
        no longer guarded let go. Where one is held by another daemon, LockHeld, and the
        locks held before are unchanged."""
        new: dict[str, HeldLock] = {}
        try:
            if keys:
                self.lock_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            for key, what in keys.items():
                if key not in self.cgroups:
                    new[key] = take_lock(_key_path(self.lock_dir, key), what)
        except BaseException:
            for lock in new.values():
                lock.release()
            raise
        for key in list(self.cgroups):
            if key not in keys:
                self.cgroups.pop(key).release()
        self.cgroups.update(new)

    def release(self) -> None:
        for lock in self.cgroups.values():
            lock.release()
        self.cgroups = {}
        if self.store is not None:
            self.store.release()
            self.store = None
        if self.node_store is not None:
            self.node_store.release()
            self.node_store = None


@contextlib.contextmanager
def held_for(config: DaemonConfig, layout: CgroupLayout) -> Iterator[DaemonLocks]:
    """The daemon's locks, taken before anything else it does, let go when it ends."""
    locks = DaemonLocks()
    try:
        try:
            locks.take_cgroups(cgroup_keys(config, layout))  # first: no store made for a refusal
            locks.take_store(config.store, config.state_dir)
        except OSError as exc:  # a read-only /run, a store path through a file
            raise OomguardError(f"cannot take the daemon's lock in "
                                f"{exc.filename or locks.lock_dir}: {exc.strerror or exc}"
                                ) from None
        yield locks
    finally:
        locks.release()
