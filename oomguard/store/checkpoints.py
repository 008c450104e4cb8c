"""The checkpoint store: one root-only directory per checkpoint, CRIU images plus meta.json.

A checkpoint is built in `.partial-<id>` and renamed to `<id>` only once its images are durable,
checksummed (XXH128SUMS, or SHA256SUMS: oomguard/store/integrity.py) and its meta.json written, so a crash
never leaves a half checkpoint that looks whole.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from oomguard.config.schema import DEFAULT_STORE
from oomguard.model.atomicfile import fsync_dir, write_atomically
from oomguard.model.checkpointmeta import (  # re-exported: what the store holds
    ID_RE,
    STATE_CHECKPOINTED,
    STATE_DUMPING,
    STATE_INCOMPLETE,
    STATE_RESTORED,
    CheckpointMeta,
    new_id,
    validate_id,
)
from oomguard.model.checksums import SUMS_FILES
from oomguard.model.errors import RestoreInProgress, StoreError
from oomguard.store.commit import image_checksums, swap_compressed
from oomguard.store.digest import Digests
from oomguard.store.hookgate import remove_gates
from oomguard.store.integrity import (
    find_sums,
    format_sums,
    preferred_algorithm,
    read_sums,
    sums_name,
    verify,
)
from oomguard.store.names import CHECKPOINT_LOCK, CONTAINERS_DIR, LAST_FAILED_LOG, PARTIAL_PREFIX

__all__ = ["COMPRESSED", "DEFAULT_STORE", "DUMP_SUCCESS", "ID_RE", "IMAGES",
           "META", "META_MAX", "STATE_CHECKPOINTED", "STATE_DUMPING",
           "STATE_INCOMPLETE", "STATE_RESTORED", "CheckpointMeta", "Store", "StoreScan",
           "dir_size", "new_id", "validate_id"]

META = "meta.json"
IMAGES = "images"
DUMP_SUCCESS = "Dumping finished successfully"  # CRIU's last log line of a complete dump
COMPRESSED = "compressed"  # meta.extra: pages files stored compressed, name -> raw bytes
META_MAX = 16 << 20  # a meta.json is a few KiB; anything this big is not ours


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def open_lock(directory: Path) -> int:
    """The fd to flock for a checkpoint directory (partial or whole): its lock file, made where
    it is missing (a checkpoint from before there was one), never through a symlink (the
    directory is refused if it is one). A file, not the directory: on NFS an flock on a file
    is a lock of the server's, seen by every node (and let go when its node's lease runs out);
    an flock on a directory is the client's alone. Close it when done; CRIU and a lazy
    restore's keeper hold it by inheriting it. Raises OSError."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.open(CHECKPOINT_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def remove_checkpoint_dir(directory: Path, lock_fd: int | None = None) -> None:
    """Remove a checkpoint directory whose lock its caller holds (`lock_fd`, closed here) or
    takes no more: everything but the lock file first, then the lock, closed, then its file
    and the directory. On NFS a file still open is only renamed (.nfsXXXX) when removed, and
    its directory cannot go until it is closed. Raises OSError (FileNotFoundError: gone)."""
    try:
        for entry in os.scandir(directory):
            if entry.name == CHECKPOINT_LOCK:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / CHECKPOINT_LOCK)
    os.rmdir(directory)


@dataclass(frozen=True)
class StoreScan:
    checkpoints: list[CheckpointMeta]
    skipped: list[tuple[str, str]]  # (entry name, why it was skipped)


class Store:
    """`algorithm`: what new checkpoints are checksummed with (default: XXH3-128 where the
    xxhash module is installed, else SHA-256); existing ones are verified with their own."""

    def __init__(self, root: Path | str = DEFAULT_STORE, algorithm: str | None = None, *,
                 state: Path | None = None) -> None:
        self.root = Path(root)
        # This node's records (ledgers, lock, CRIU's action script): the store itself unless
        # the store is shared with other nodes (oomguard.store.nodestate).
        self.state = self.root if state is None else Path(state)
        self._algorithm = algorithm

    @property
    def algorithm(self) -> str:
        if self._algorithm is None:
            self._algorithm = preferred_algorithm()
        return self._algorithm

    def ensure(self) -> None:
        """Create the root (0700, images hold every secret of a process) or tighten it; and
        the node's state directory, where that is elsewhere (0700 too)."""
        for directory in dict.fromkeys((self.root, self.state)):
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                if directory.stat().st_mode & 0o077:
                    directory.chmod(0o700)
            except OSError as exc:
                raise StoreError(f"cannot use store {directory}: {exc.strerror}") from exc

    def path_of(self, checkpoint_id: str) -> Path:
        return self.root / validate_id(checkpoint_id)

    def images_of(self, checkpoint_id: str) -> Path:
        return self.path_of(checkpoint_id) / IMAGES

    def begin(self, meta: CheckpointMeta) -> tuple[Path, int]:
        """A fresh partial directory holding a provisional meta.json (state "dumping", so a
        restart can finish or discard it), locked (flock) by the returned fd. Returns the
        images directory and the lock fd: pass it on to CRIU, close it when done."""
        self.ensure()
        partial = self.root / (PARTIAL_PREFIX + validate_id(meta.id))
        try:
            partial.mkdir(mode=0o700)
            (partial / IMAGES).mkdir(mode=0o700)
            lock_fd = open_lock(partial)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            meta.state = STATE_DUMPING
            write_atomically(partial / META, meta.to_json())
        except OSError as exc:
            raise StoreError(f"cannot create checkpoint in {self.root}: {exc.strerror}") from exc
        return partial / IMAGES, lock_fd

    def commit(self, meta: CheckpointMeta, digests: Digests | None = None) -> Path:
        """Images durable, checksummed, meta.json final, then the rename that makes it whole.
        `digests`: checksums taken during the dump (oomguard/store/digest.py); a file they do
        not cover as it is now is hashed here, read back (a crash recovery: all of them)."""
        partial = self.root / (PARTIAL_PREFIX + validate_id(meta.id))
        images = partial / IMAGES
        remove_gates(partial)  # FIFOs of a hook gate whose oomguard died
        compressed = swap_compressed(images, digests, self.algorithm)
        if compressed:
            meta.extra[COMPRESSED] = compressed
        sums = image_checksums(images, digests, self.algorithm)
        meta.image_bytes = dir_size(images)
        meta.state = STATE_CHECKPOINTED
        name = sums_name(self.algorithm)
        for other in set(SUMS_FILES.values()) - {name}:  # a failed commit's, by another version
            with contextlib.suppress(FileNotFoundError):
                (partial / other).unlink()
        write_atomically(partial / name, format_sums(sums))
        write_atomically(partial / META, meta.to_json())
        final = self.path_of(meta.id)
        partial.rename(final)
        fsync_dir(self.root)
        return final

    def sums_of(self, checkpoint_id: str) -> tuple[Path, str, dict[str, str]]:
        """A checkpoint's checksum file, its algorithm and the digests it holds. Raises
        StoreError (missing, unreadable, malformed)."""
        path, algorithm = find_sums(self.path_of(checkpoint_id))
        return path, algorithm, read_sums(path)

    def verify(self, checkpoint_id: str) -> None:
        """Every image against the checkpoint's checksums (XXH128SUMS or SHA256SUMS)."""
        path = self.path_of(checkpoint_id)
        verify(path / IMAGES, find_sums(path)[0])

    def recover_partials(self) -> list[tuple[str, str]]:
        """After a crash: finish the partial checkpoints whose dump completed (CRIU logged
        success, so the tree is gone and the images were synced by the post-dump hook) and
        delete the others (their dump failed: CRIU resumed the tree). A partial still locked
        belongs to a CRIU that is still running: left alone. Returns (id, what was done)."""
        done = []
        for partial in self.partials():
            checkpoint_id = partial.name[len(PARTIAL_PREFIX):]
            try:
                fd: int | None = open_lock(partial)
            except OSError:
                continue
            assert fd is not None
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    done.append((checkpoint_id, "in progress"))
                    continue
                log = partial / IMAGES / "dump.log"
                finished = log.is_file() and DUMP_SUCCESS in log.read_text(errors="replace")
                try:
                    meta = CheckpointMeta.from_json((partial / META).read_text())
                except (OSError, ValueError, TypeError):
                    meta = None
                if finished and meta is not None and meta.id == checkpoint_id:
                    meta.extra["recovered"] = True
                    try:
                        self.commit(meta)
                    except (OSError, StoreError) as exc:
                        # Never deleted: its process is gone and these images are all of it.
                        done.append((checkpoint_id, f"incomplete: {_reason(exc)}"))
                        continue
                    done.append((checkpoint_id, "completed"))
                else:
                    held, fd = fd, None
                    with contextlib.suppress(OSError):
                        remove_checkpoint_dir(partial, held)
                    done.append((checkpoint_id, "removed"))
            finally:
                if fd is not None:
                    os.close(fd)
        return done

    def keep_failed_log(self, checkpoint_id: str) -> None:
        """CRIU's log of a failed dump, kept as <store>/.last-failed-dump.log (the event holds
        only its error lines) before the partial is removed."""
        log = self.root / (PARTIAL_PREFIX + validate_id(checkpoint_id)) / IMAGES / "dump.log"
        with contextlib.suppress(OSError):
            if log.is_file() and not log.is_symlink():
                write_atomically(self.state / LAST_FAILED_LOG, log.read_text(errors="replace"))

    def abort(self, checkpoint_id: str, lock_fd: int | None = None) -> None:
        """Remove a failed dump's partial. `lock_fd`: the lock begin() returned, closed here
        (after the rest of the partial is gone, before its lock file is: see
        remove_checkpoint_dir)."""
        partial = self.root / (PARTIAL_PREFIX + validate_id(checkpoint_id))
        try:
            remove_checkpoint_dir(partial, lock_fd)
        except FileNotFoundError:
            pass
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)  # what is left: recover_partials' then

    def partials(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.name.startswith(PARTIAL_PREFIX))

    def list(self) -> list[CheckpointMeta]:
        """Every well-formed checkpoint, oldest first (see scan() for the others)."""
        return self.scan().checkpoints

    def complete(self, checkpoint_id: str) -> CheckpointMeta:
        """Finish the commit of an incomplete checkpoint (dumped, but its commit failed: a full
        disk...). Raises StoreError saying why it still cannot be finished."""
        meta = self._finished_partial(validate_id(checkpoint_id))
        if meta is None:
            raise StoreError(f"checkpoint {checkpoint_id} has no finished dump to complete")
        partial = self.root / (PARTIAL_PREFIX + checkpoint_id)
        try:
            fd = open_lock(partial)
        except OSError as exc:
            raise StoreError(f"checkpoint {checkpoint_id} cannot be completed: "
                             f"{_reason(exc)}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreError(f"checkpoint {checkpoint_id} is being completed right now") \
                    from None
            try:
                self.commit(meta)
            except (OSError, StoreError) as exc:
                raise StoreError(f"checkpoint {checkpoint_id} cannot be completed yet "
                                 f"({_reason(exc)}); its images are intact in {partial}") \
                    from exc
        finally:
            os.close(fd)
        return meta

    def _finished_partial(self, checkpoint_id: str) -> CheckpointMeta | None:
        """The provisional meta of a partial whose dump finished (CRIU logged success, so its
        process is gone) and that no CRIU or oomguard holds now, as state "incomplete"."""
        partial = self.root / (PARTIAL_PREFIX + checkpoint_id)
        try:
            fd = open_lock(partial)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # a dump still writing, or its oomguard still deciding
            fcntl.flock(fd, fcntl.LOCK_UN)
            log = partial / IMAGES / "dump.log"
            if log.is_symlink() or not log.is_file() or \
                    DUMP_SUCCESS not in log.read_text(errors="replace"):
                return None
            meta = CheckpointMeta.from_json((partial / META).read_text())
        except (OSError, ValueError, TypeError):
            return None
        finally:
            os.close(fd)
        if meta.id != checkpoint_id:
            return None
        meta.state = STATE_INCOMPLETE
        return meta

    def scan(self) -> StoreScan:
        """The checkpoints, and the entries skipped with the reason: a symlink (never followed:
        a user could point one anywhere), or a missing, unreadable or malformed meta.json."""
        if not self.root.is_dir():
            return StoreScan([], [])
        metas, skipped = [], []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(PARTIAL_PREFIX) and not entry.is_symlink():
                incomplete = self._finished_partial(entry.name[len(PARTIAL_PREFIX):])
                if incomplete is not None:
                    metas.append(incomplete)
                continue
            if entry.name.startswith(".") or entry.name == CONTAINERS_DIR:
                continue  # oomguard's own (store.names)
            try:
                metas.append(self._read_meta(entry.name))
            except StoreError as exc:
                skipped.append((entry.name, str(exc)))
        return StoreScan(sorted(metas, key=lambda m: m.created), skipped)

    def _read_meta(self, name: str) -> CheckpointMeta:
        """meta.json of store entry `name`, following no symlink on the way."""
        try:
            dir_fd = os.open(self.root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                             | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StoreError(f"no checkpoint {name!r} in {self.root}") from None
        except OSError as exc:
            what = "a symlink (not followed)" if (self.root / name).is_symlink() else \
                "not a checkpoint directory" if exc.errno == errno.ENOTDIR else exc.strerror
            raise StoreError(f"store entry {name!r} is {what}") from None
        try:
            try:
                fd = os.open(META, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                raise StoreError(f"no checkpoint {name!r} in {self.root} (no {META})") from None
            except OSError as exc:
                raise StoreError(f"store entry {name!r}: {META} cannot be opened "
                                 f"({exc.strerror}; a symlink is never followed)") from None
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise StoreError(f"store entry {name!r}: {META} is not a regular file")
                raw = handle.read(META_MAX + 1)
        finally:
            os.close(dir_fd)
        if len(raw) > META_MAX:
            raise StoreError(f"store entry {name!r}: {META} is larger than {META_MAX} bytes")
        try:
            meta = CheckpointMeta.from_json(raw.decode("utf-8", errors="replace"))
        except (ValueError, TypeError) as exc:
            raise StoreError(f"checkpoint {name!r} has an unreadable meta.json: {exc}") from None
        if meta.id != name:
            raise StoreError(f"store entry {name!r}: its meta.json names {meta.id!r}")
        return meta

    def get(self, checkpoint_id: str) -> CheckpointMeta:
        """A checkpoint's meta; an incomplete one (its commit failed) as state "incomplete"."""
        validate_id(checkpoint_id)
        if not os.path.lexists(self.root / checkpoint_id):
            incomplete = self._finished_partial(checkpoint_id)
            if incomplete is not None:
                return incomplete
        return self._read_meta(checkpoint_id)

    @contextlib.contextmanager
    def restore_lock(self, checkpoint_id: str) -> Iterator[int]:
        """Held while a checkpoint is restored, by whichever path (the daemon's socket, its
        auto-restore, the CLI without a daemon, on this node or another sharing the store): a
        second restore at the same time is refused instead of running the process twice. An
        flock on its lock file: it dies with its holder, and with whatever inherited the
        yielded fd (a lazy restore's keeper, until every page is in)."""
        fd = self._take_restore_lock(checkpoint_id)
        try:
            yield fd
        finally:
            os.close(fd)

    def _take_restore_lock(self, checkpoint_id: str) -> int:
        try:
            fd = open_lock(self.path_of(checkpoint_id))
        except OSError as exc:
            raise StoreError(f"no checkpoint {checkpoint_id!r} in {self.root}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RestoreInProgress(f"checkpoint {checkpoint_id} is being restored right now "
                                    "(by the daemon or another oomguard, or its pages are "
                                    "still streaming in after a lazy restore)") from None
        return fd

    def write_private(self, path: Path, text: str) -> None:
        """A file of oomguard's own inside a checkpoint directory: made anew (O_EXCL, never
        through a symlink), durable."""
        write_atomically(path, text)

    def update(self, meta: CheckpointMeta) -> None:
        write_atomically(self.path_of(meta.id) / META, meta.to_json())

    def forget(self, checkpoint_id: str) -> None:
        """Delete a checkpoint; a symlink or malformed entry is refused, never followed, and so
        is one being restored (its images are being read: by CRIU, or a lazy restore's
        lazy-pages daemon)."""
        self._read_meta(validate_id(checkpoint_id))
        # Removed under its lock, which goes last (remove_checkpoint_dir: NFS keeps an open
        # file's directory until it is closed).
        remove_checkpoint_dir(self.path_of(checkpoint_id), self._take_restore_lock(checkpoint_id))
        # Durably gone: the journal's commit is what hands the blocks back to the file system
        # (ext4 counts them free only then: the store's budget reads it right after).
        with contextlib.suppress(OSError):
            fsync_dir(self.root)
