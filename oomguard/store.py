"""The checkpoint store: one root-only directory per checkpoint, CRIU images plus meta.json.

A checkpoint is built in `.partial-<id>` and renamed to `<id>` only once its images are durable
and its meta.json written, so a crash never leaves a half checkpoint that looks whole.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from oomguard.criu_hook import sync_and_drop
from oomguard.errors import StoreError
from oomguard.integrity import CHECKSUMS, compute, format_sums, verify

DEFAULT_STORE = Path("/var/lib/oomguard")
META = "meta.json"
IMAGES = "images"
PARTIAL_PREFIX = ".partial-"
STATE_DUMPING = "dumping"
STATE_CHECKPOINTED = "checkpointed"
STATE_RESTORED = "restored"
DUMP_SUCCESS = "Dumping finished successfully"  # CRIU's last log line of a complete dump
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


@dataclass
class CheckpointMeta:
    id: str
    pid: int  # root of the dumped tree (host PID)
    pids: list[int]  # every task of the tree: CRIU restores these PIDs
    command: str
    comm: str
    uid: int
    user: str
    cgroup: str  # memory cgroup path inside its hierarchy
    cgroup_version: int
    rss_bytes: int
    reason: str
    criu_version: str
    created: float
    pidns: bool = False  # the tree is the init of its own PID namespace (`oomguard exec`)
    image_bytes: int = 0
    dump_seconds: float = 0.0
    state: str = "checkpointed"  # dumping (provisional) | checkpointed | restored
    restored_at: float | None = None
    restored_pid: int | None = None
    restored_cgroup: str | None = None
    gpu_pids: list[int] = field(default_factory=list)  # CUDA processes (pids in the tree's
    # own PID namespace): their state was moved off the GPU with cuda-checkpoint before the dump
    gpu_engine: str = ""  # what checkpointed their CUDA state: cuda-checkpoint | criu-plugin
    vram_bytes: int = 0
    stopped_nspids: list[int] = field(default_factory=list)  # tasks the user had stopped
    # (pids in the tree's own PID namespace): restored stopped, never continued by oomguard
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("meta.json is not a JSON object")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def validate_id(checkpoint_id: str) -> str:
    """Ids name directories: letters, digits, '-' and '_' only (no '/', no '..', no dotfiles)."""
    if not isinstance(checkpoint_id, str) or not ID_RE.fullmatch(checkpoint_id):
        raise StoreError(f"invalid checkpoint id {checkpoint_id!r}")
    return checkpoint_id


def new_id(pid: int, now: float) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"{stamp}-{pid}-{secrets.token_hex(2)}"


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class Store:
    def __init__(self, root: Path | str = DEFAULT_STORE) -> None:
        self.root = Path(root)

    def ensure(self) -> None:
        """Create the root (0700, images hold every secret of a process) or tighten it."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.root.stat().st_mode & 0o077:
                self.root.chmod(0o700)
        except OSError as exc:
            raise StoreError(f"cannot use store {self.root}: {exc.strerror}") from exc

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
            lock_fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)  # inheritable on purpose
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            meta.state = STATE_DUMPING
            _write_durably(partial / META, meta.to_json())
        except OSError as exc:
            raise StoreError(f"cannot create checkpoint in {self.root}: {exc.strerror}") from exc
        return partial / IMAGES, lock_fd

    def commit(self, meta: CheckpointMeta) -> Path:
        """Images durable, checksummed, meta.json final, then the rename that makes it whole."""
        partial = self.root / (PARTIAL_PREFIX + validate_id(meta.id))
        images = partial / IMAGES
        sync_and_drop(str(images))
        meta.image_bytes = dir_size(images)
        meta.state = STATE_CHECKPOINTED
        _write_durably(partial / CHECKSUMS, format_sums(compute(images)))
        _write_durably(partial / META, meta.to_json())
        final = self.path_of(meta.id)
        partial.rename(final)
        _fsync_dir(self.root)
        return final

    def verify(self, checkpoint_id: str) -> None:
        path = self.path_of(checkpoint_id)
        verify(path / IMAGES, path / CHECKSUMS)

    def recover_partials(self) -> list[tuple[str, str]]:
        """After a crash: finish the partial checkpoints whose dump completed (CRIU logged
        success, so the tree is gone and the images were synced by the post-dump hook) and
        delete the others (their dump failed: CRIU resumed the tree). A partial still locked
        belongs to a CRIU that is still running: left alone. Returns (id, what was done)."""
        done = []
        for partial in self.partials():
            checkpoint_id = partial.name[len(PARTIAL_PREFIX):]
            try:
                fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
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
                    self.commit(meta)
                    done.append((checkpoint_id, "completed"))
                else:
                    shutil.rmtree(partial, ignore_errors=True)
                    done.append((checkpoint_id, "removed"))
            finally:
                os.close(fd)
        return done

    def abort(self, checkpoint_id: str) -> None:
        partial = self.root / (PARTIAL_PREFIX + validate_id(checkpoint_id))
        shutil.rmtree(partial, ignore_errors=True)

    def partials(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.name.startswith(PARTIAL_PREFIX))

    def list(self) -> list[CheckpointMeta]:
        if not self.root.is_dir():
            return []
        metas = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not (entry / META).is_file():
                continue
            try:
                metas.append(CheckpointMeta.from_json((entry / META).read_text()))
            except (ValueError, TypeError):
                continue
        return sorted(metas, key=lambda m: m.created)

    def get(self, checkpoint_id: str) -> CheckpointMeta:
        path = self.path_of(checkpoint_id) / META
        try:
            return CheckpointMeta.from_json(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"no checkpoint {checkpoint_id!r} in {self.root}") from None
        except (ValueError, TypeError) as exc:
            raise StoreError(f"checkpoint {checkpoint_id!r} has an unreadable meta.json") from exc

    def update(self, meta: CheckpointMeta) -> None:
        _write_durably(self.path_of(meta.id) / META, meta.to_json())

    def forget(self, checkpoint_id: str) -> None:
        path = self.path_of(checkpoint_id)
        if not (path / META).is_file():
            raise StoreError(f"no checkpoint {checkpoint_id!r} in {self.root}")
        shutil.rmtree(path)
