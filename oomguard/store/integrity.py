"""Checksums of a checkpoint's image files: written at checkpoint time, verified before restore.

A damaged image restored by CRIU can crash the process or, worse, let it run on with corrupt
memory; so restore refuses a checkpoint whose files do not match.

Two algorithms, each with its file beside images/ in the `sha256sum -c` format:

- XXH3-128 (`XXH128SUMS`, `xxh128sum -c`; the default): the checksums are taken while CRIU
  writes the pages and verified while CRIU reads them, sharing the machine's cores with CRIU,
  so their CPU cost is what matters. On the development VM (2 vCPUs, one of them busy) a 1 GiB
  dump took 1.3 s with XXH3 (15 GB/s on one core), 1.6-2.8 s with BLAKE3 (3.3 GB/s) and
  1.7-1.9 s with SHA-256 (1.6 GB/s with SHA-NI), and BLAKE3's follower fell behind the page
  cache (CRIU's cgroup keeps 256 MiB of it) and had to read back from disk. XXH3 is not
  cryptographic: it finds damage (a disk, a copy, a truncation), not forgery, and so would a
  cryptographic hash here, since whoever can rewrite the root-only images can rewrite the
  checksums beside them.
- SHA-256 (`SHA256SUMS`, hashlib): checkpoints made before, and `checksum = "sha256"`.

Verification takes whichever file the checkpoint has.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from oomguard.model.checksums import CHECKSUMS, DIGEST_HEX, SHA256, SUMS_FILES, XXH3
from oomguard.model.errors import StoreError

READ_BLOCK = 4 << 20  # bytes per read: large enough to stream at disk speed
# Reading from disk, the next PREFETCH bytes are asked for ahead (POSIX_FADV_WILLNEED, in
# PREFETCH_STEP pieces): several reads in flight. On the development VM's virtio disk a cold
# 1 GiB file hashed at 410-720 MB/s reading one block at a time, 900-1330 MB/s so.
PREFETCH = 32 << 20
PREFETCH_STEP = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def hasher_factory(algorithm: str) -> Callable[[], Hasher]:
    """A constructor of fresh hashers; raises StoreError if `algorithm` is unknown or its
    module is not installed."""
    if algorithm == SHA256:
        return hashlib.sha256
    if algorithm == XXH3:
        try:
            module = importlib.import_module("xxhash")
        except ImportError:
            raise StoreError("this checkpoint's checksums are XXH3-128 (XXH128SUMS) and the "
                             "xxhash module is not installed: pip install xxhash") from None
        factory: Callable[[], Hasher] = module.xxh3_128
        return factory
    raise StoreError(f"unknown checksum algorithm {algorithm!r}")


def preferred_algorithm() -> str:
    """XXH3 where the module is installed (a dependency of oomguard), else SHA-256."""
    try:
        hasher_factory(XXH3)
    except StoreError:
        return SHA256
    return XXH3


def sums_name(algorithm: str) -> str:
    try:
        return SUMS_FILES[algorithm]
    except KeyError:
        raise StoreError(f"unknown checksum algorithm {algorithm!r}") from None


def find_sums(checkpoint_dir: Path) -> tuple[Path, str]:
    """The checksum file a checkpoint has and its algorithm (XXH128SUMS before SHA256SUMS);
    the path of SHA256SUMS, not existing, where it has neither."""
    for algorithm, name in SUMS_FILES.items():
        path = checkpoint_dir / name
        if os.path.lexists(path):
            return path, algorithm
    return checkpoint_dir / CHECKSUMS, SHA256


def algorithm_of(sums_file: Path) -> str:
    for algorithm, name in SUMS_FILES.items():
        if sums_file.name == name:
            return algorithm
    return SHA256  # any other name: the original format


def hash_block(fd: int, hasher: Hasher, view: memoryview, offset: int, size: int,
               flags: int = 0) -> int:
    """Hash a file's next block: what `view` holds (READ_BLOCK at most) from `offset`, not
    past `size`, read with preadv(2) and `flags` (RWF_NOWAIT: only what the page cache has,
    BlockingIOError otherwise). Returns the bytes hashed: 0 at the end (or past `size`)."""
    want = min(len(view), READ_BLOCK, size - offset)
    if want <= 0:
        return 0
    count = os.preadv(fd, [view[:want]], offset, flags)
    hasher.update(view[:count])
    return count


def digest_file(path: Path, algorithm: str = SHA256, *, drop_cache: bool = True,
                stop: Callable[[], bool] | None = None, prefetch: int = PREFETCH) -> str:
    """The file's digest, read in large blocks, `prefetch` bytes asked for ahead. `drop_cache`:
    give back the page cache the reading pulled in (charged to us). `stop`: asked between
    blocks; when it says so, reading ends early (the digest is then of a prefix: the caller
    discards it)."""
    hasher = hasher_factory(algorithm)()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        buffer = bytearray(max(min(READ_BLOCK, size), 4096))  # most images are a few bytes
        view = memoryview(buffer)
        offset = advised = 0
        while stop is None or not stop():
            while prefetch and size > READ_BLOCK and advised < min(offset + prefetch, size):
                os.posix_fadvise(fd, advised, PREFETCH_STEP, os.POSIX_FADV_WILLNEED)
                advised += PREFETCH_STEP
            count = os.readv(fd, [buffer])
            if count == 0:
                break
            offset += count
            hasher.update(view[:count])
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return hasher.hexdigest()


def image_files(images: Path) -> list[Path]:
    """The files that make up the images (CRIU's logs are not part of the state)."""
    return sorted(p for p in images.iterdir()
                  if p.is_file() and not p.is_symlink() and not p.name.endswith(".log"))


def compute(images: Path, algorithm: str = SHA256) -> dict[str, str]:
    return {p.name: digest_file(p, algorithm) for p in image_files(images)}


def format_sums(sums: dict[str, str]) -> str:
    """sha256sum(1) format: `sha256sum -c` (`xxh128sum -c`) verifies it from inside
    images/."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))


def parse_sums(text: str, sums_name: str = CHECKSUMS) -> dict[str, str]:
    width = DIGEST_HEX[algorithm_of(Path(sums_name))]
    sums = {}
    for number, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != width or not name or "/" in name:
            raise StoreError(f"{sums_name} line {number} is malformed")
        sums[name] = digest
    return sums


def read_sums(sums_file: Path) -> dict[str, str]:
    """The expected digests; raises StoreError when the file is missing, unreadable or
    malformed."""
    try:
        return parse_sums(sums_file.read_text(), sums_file.name)
    except FileNotFoundError:
        raise StoreError(f"checkpoint has no {sums_file.name}: cannot verify its images") \
            from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"checkpoint's {sums_file.name} is unreadable: {exc}") from None


def listing_problems(images: Path, expected: dict[str, str], sums_name: str) -> list[str]:
    """Files missing from images/, and files there that the checksums do not name."""
    actual_names = {p.name for p in image_files(images)}
    problems = [f"{name} missing" for name in sorted(set(expected) - actual_names)]
    problems += [f"{name} not in {sums_name}" for name in sorted(actual_names - set(expected))]
    return problems


def damaged(problems: list[str]) -> StoreError:
    return StoreError("checkpoint is damaged: " + "; ".join(problems))


def verify(images: Path, sums_file: Path) -> None:
    """Raise StoreError naming every file that is missing, unexpected or altered."""
    expected = read_sums(sums_file)
    algorithm = algorithm_of(sums_file)
    problems = listing_problems(images, expected, sums_file.name)
    present = {p.name for p in image_files(images)}
    for name in sorted(set(expected) & present):
        if digest_file(images / name, algorithm) != expected[name]:
            problems.append(f"{name} checksum mismatch")
    if problems:
        raise damaged(problems)
