"""Compressed pages (`[criu] compress = "zstd"`): pages-N.img stored as pages-N.img.zst.

A packer thread follows each pages file as CRIU writes it and feeds it to a zstd stream, from
the page cache while it is still there, at the lowest CPU priority (nice 19: CRIU and the
digest come first), and never holds up the dump: CRIU's post-dump action does not wait for it,
so the job's memory is freed as soon as without compression; what the packer has not done by
then it finishes after CRIU, reading the rest back, and the commit then swaps the files. zstd
compresses text at 160-200 MB/s on the development VM, slower than its disk: there the commit
of compressible memory takes longer, the dump does not. Memory that does not compress (its
first 64 MiB shrink by less than a tenth) is left as it is. A zstd frame carries its own checksum of the
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
import re
import threading
from pathlib import Path
from typing import Any

from oomguard.model.errors import StoreError
from oomguard.store.integrity import READ_BLOCK, hasher_factory

SUFFIX = ".zst"
SAMPLE = 64 << 20  # raw bytes after which a stream that saved under a tenth is given up
MIN_SAVING = 0.10
PLAIN_PAGES = re.compile(r"^pages-\d+\.img$")  # appended to, never rewritten, by CRIU
FOLLOW_INTERVAL = 0.01
LOWEST_PRIORITY = 19


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


class Packer:
    """Compresses the pages files of a dump in `images` as they grow, in a thread of its own,
    until finish() (CRIU has exited: the files are whole) or abandon()."""

    def __init__(self, images: Path, level: int) -> None:
        _zstd()  # raises StoreError now if the module is missing
        self.images = images
        self.level = level
        self._streams: dict[str, PageCompressor] = {}
        self._offsets: dict[str, int] = {}
        self._whole = threading.Event()  # CRIU has exited: read to the end, then stop
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pages-packer", daemon=True)
        self._thread.start()

    def finish(self) -> tuple[dict[str, Path], dict[str, int]]:
        """Every file compressed to its end: ({name: NAME.zst}, {name: raw bytes}) of those
        kept; none where the packer failed."""
        self._whole.set()
        self._thread.join()
        if self._failed is not None:
            self.abandon()
            return {}, {}
        kept = {name: s.path for name, s in self._streams.items() if s.finish()}
        return kept, {name: self._streams[name].raw_bytes for name in kept}

    def abandon(self) -> None:
        self._stop.set()
        self._thread.join()
        for stream in self._streams.values():
            stream.give_up()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        buffer = bytearray(READ_BLOCK)
        try:
            while not self._stop.is_set():
                whole = self._whole.is_set()
                moved = self._pass(memoryview(buffer))
                if whole and not moved:
                    return
                if not moved:
                    self._whole.wait(FOLLOW_INTERVAL)
        except (OSError, StoreError) as exc:
            self._failed = exc

    def _pass(self, view: memoryview) -> bool:
        """Feed what was appended since the last look; whether anything was."""
        moved = False
        for name in sorted(os.listdir(self.images)):
            if not PLAIN_PAGES.match(name) or self._stop.is_set():
                continue
            stream = self._streams.get(name)
            if stream is None:
                stream = self._streams[name] = PageCompressor(self.images / name, self.level)
                self._offsets[name] = 0
            if stream.given_up:
                continue
            fd = os.open(self.images / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                start = self._offsets[name]
                while not stream.given_up and not self._stop.is_set():
                    count = os.preadv(fd, [view], self._offsets[name])
                    if count == 0:
                        break
                    stream.feed(view[:count])
                    self._offsets[name] += count
                    moved = True
                # Read (the digester leaves these pages for us): writeback now, cache gone.
                os.posix_fadvise(fd, start, self._offsets[name] - start,
                                 os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return moved


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
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read once
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
