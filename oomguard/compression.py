"""Compressed pages (`[criu] compress = "zstd"`): pages-N.img stored as pages-N.img.zst.

The dump's digester (oomguard/imagedigest.py) feeds each pages file to a zstd stream as CRIU
writes it, from the page cache, so compressing costs no second read and holds up nothing: the
job's memory is freed as soon as without compression, and the commit only swaps the files.
Memory that does not compress (its first 64 MiB shrink by less than a tenth) is left as it is:
writing it twice would slow the dump for nothing. A zstd frame carries its own checksum of the
content; the checkpoint's checksums (XXH128SUMS) cover the stored .zst, so `xxh128sum -c` checks
the store as it is.

CRIU reads only plain pages files, so a restore expands each .zst back to pages-N.img first
(verifying the stored bytes' checksum as it reads them, and the frame's content checksum),
lets CRIU read that from the page cache, and removes it afterwards; a compressed checkpoint is
therefore restored eagerly, not lazily. Needs the zstandard module (installed with oomguard).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import Any

from oomguard.errors import StoreError
from oomguard.integrity import READ_BLOCK, hasher_factory

SUFFIX = ".zst"
SAMPLE = 64 << 20  # raw bytes after which a stream that saved under a tenth is given up
MIN_SAVING = 0.10


def _zstd() -> Any:
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        raise StoreError("compressed pages need the zstandard module: pip install "
                         "zstandard") from None


def compressed_name(name: str) -> str:
    return name + SUFFIX


def raw_name(name: str) -> str:
    return name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name


class PageCompressor:
    """One pages file's zstd stream into NAME.zst beside it, fed as the file grows. Raises
    StoreError (no zstandard) or OSError."""

    def __init__(self, raw: Path, level: int) -> None:
        zstd = _zstd()
        self.path = raw.with_name(compressed_name(raw.name))
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a leftover of an earlier attempt: never followed
        self.fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                      | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._stream = zstd.ZstdCompressor(level=level, write_checksum=True).compressobj()
        self.raw_bytes = 0
        self.stored_bytes = 0
        self.given_up = False

    def feed(self, data: memoryview) -> None:
        if self.fd is None:
            return
        self._write(self._stream.compress(data))
        self.raw_bytes += len(data)
        if self.raw_bytes >= SAMPLE and self.stored_bytes > (1 - MIN_SAVING) * self.raw_bytes:
            self.give_up()

    def finish(self) -> bool:
        """The stream's end written; False if it was given up (nothing to keep)."""
        if self.fd is None:
            return False
        self._write(self._stream.flush())
        os.close(self.fd)
        self.fd = None
        return True

    def give_up(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.given_up = True
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _write(self, data: bytes) -> None:
        assert self.fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        self.stored_bytes += len(data)


def compressed_pages(images: Path) -> list[Path]:
    return sorted(p for p in images.glob(f"pages-*.img{SUFFIX}")
                  if p.is_file() and not p.is_symlink())


def expand(stored: Path, digest: str, algorithm: str) -> Path:
    """pages-N.img.zst -> pages-N.img (temporary: the caller removes it), checking the stored
    bytes against `digest` as they are read and the content against the frame's checksum.
    Raises StoreError naming the file when either does not match."""
    zstd = _zstd()
    target = stored.with_name(raw_name(stored.name))
    with contextlib.suppress(FileNotFoundError):
        target.unlink()  # left by a restore that died
    hasher = hasher_factory(algorithm)()

    class Hashing:
        """What the decompressor reads, hashed on the way."""

        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def read(self, size: int = -1) -> bytes:
            data: bytes = self.handle.read(size)
            hasher.update(data)
            return data

    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600)
    try:
        with open(stored, "rb") as handle:
            reader = zstd.ZstdDecompressor().stream_reader(Hashing(handle), read_size=READ_BLOCK)
            while chunk := reader.read(READ_BLOCK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
            while handle.read(READ_BLOCK):  # anything after the frame counts too
                pass
    except zstd.ZstdError as exc:
        os.close(out)
        target.unlink()
        raise StoreError(f"checkpoint is damaged: {stored.name} does not decompress "
                         f"({exc})") from None
    except BaseException:
        os.close(out)
        target.unlink()
        raise
    os.close(out)
    if hasher.hexdigest() != digest:
        target.unlink()
        raise StoreError(f"checkpoint is damaged: {stored.name} checksum mismatch")
    return target
