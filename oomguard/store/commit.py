"""The images' part of a commit (Store.commit): every image checksummed and durable, with as
little read back and synced as the dump's digests allow (oomguard/store/digest.py), and
compressed pages swapped in for the plain ones (oomguard/store/compression.py)."""

from __future__ import annotations

import os
from pathlib import Path

from oomguard.model.atomicfile import fsync_dir
from oomguard.store.compression import SUFFIX, compressed_pages, raw_name
from oomguard.store.digest import Digests
from oomguard.store.integrity import digest_file, image_files


def _sync_and_drop(path: Path) -> None:
    """fdatasync one image, then give back its page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def swap_compressed(images: Path, digests: Digests | None,
                    algorithm: str) -> dict[str, int]:
    """Pages files the digester wrote compressed too: the .zst made durable, then the
    plain file removed. A .zst the digests do not vouch for (an interrupted dump's, a
    crash's) goes instead: the plain file is the one kept. Returns name -> raw bytes."""
    vouched = digests.compressed if digests is not None and \
        digests.algorithm == algorithm else {}
    kept = {}
    for stored in compressed_pages(images):
        raw = images / raw_name(stored.name)
        if not raw.exists():
            continue  # a crash after the swap: the .zst is the stored file
        taken = digests.files if digests is not None else {}
        if stored.name.endswith(SUFFIX) and raw.name in vouched and \
                raw.name in taken and taken[raw.name].matches(raw.lstat()) and \
                stored.name in taken and taken[stored.name].matches(stored.lstat()):
            _sync_and_drop(stored)
            raw.unlink()
            kept[raw.name] = vouched[raw.name]
        else:
            stored.unlink()
    if kept:
        fsync_dir(images)
    return kept


def image_checksums(images: Path, digests: Digests | None,
                    algorithm: str) -> dict[str, str]:
    """Every image's digest; each one not known from `digests` is read, fdatasynced and
    its cache dropped (so is every one, where the post-dump action did not sync them)."""
    known = digests.files if digests is not None and \
        digests.algorithm == algorithm else {}
    synced = digests is not None and digests.at_post_dump
    sums = {}
    for path in image_files(images):
        taken = known.get(path.name)
        if taken is not None and taken.matches(path.lstat()):
            sums[path.name] = taken.digest
            if synced or path.name.endswith(SUFFIX):  # a .zst: synced by the swap
                continue
        else:
            sums[path.name] = digest_file(path, algorithm, drop_cache=False)
        _sync_and_drop(path)
    fsync_dir(images)
    return sums
