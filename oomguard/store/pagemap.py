"""Where a checkpoint's memory lies in its pages images, from CRIU's pagemap-PID.img.

Every CRIU image opens with the common magic and its own (8 bytes); a pagemap image then holds
records of a 4-byte little-endian length and a protobuf message: first a pagemap_head
(field 1: the N of its pages-N.img), then one pagemap_entry per run of pages (field 1: vaddr,
2: compat_nr_pages, 4: flags, 5: nr_pages). Only PE_PRESENT entries have their bytes in the
pages image, one after the other in the order of the entries (criu/pagemap.c).

A lazy restore uses it to warm the page cache with a job's small runs of memory (its stacks,
its heap, its libraries' data: what it touches first when it runs again) before CRIU starts,
and to leave the bulk (the big buffers) to the lazy-pages daemon.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from oomguard.model.errors import StoreError

PAGE = 4096
PE_PRESENT = 1 << 2
MAGIC_BYTES = 8
MAX_PAGEMAP = 64 << 20  # a pagemap image larger than this is not read (1 TiB of memory)


@dataclass(frozen=True)
class PageRun:
    """Pages contiguous both in the job's memory and in the pages image."""

    pages_file: str  # pages-N.img
    vaddr: int
    offset: int  # in pages_file
    length: int  # bytes


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise StoreError("protobuf: a number runs past its message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def message_fields(message: bytes) -> dict[int, int | bytes]:
    """A protobuf message's varint fields (numbers) and length-delimited ones (bytes: strings
    and nested messages); fixed-width ones are skipped. Raises StoreError."""
    found: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(message):
        key, pos = _varint(message, pos)
        kind = key & 7
        if kind == 0:
            found[key >> 3], pos = _varint(message, pos)
        elif kind == 2:
            size, pos = _varint(message, pos)
            found[key >> 3] = message[pos:pos + size]
            pos += size
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            raise StoreError(f"protobuf: a field of unknown wire type {kind}")
    if pos != len(message):
        raise StoreError("protobuf: a field runs past its message")
    return found


def message_numbers(message: bytes) -> dict[int, int]:
    """The varint fields of a protobuf message. Raises StoreError."""
    return {key: value for key, value in message_fields(message).items()
            if isinstance(value, int)}


def image_records(path: Path, limit: int = MAX_PAGEMAP) -> list[dict[int, int]]:
    """The varint fields of each record of a CRIU image (after its magic: a 4-byte
    little-endian length, then a protobuf message). Raises StoreError."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise StoreError(f"image {path.name}: {exc}") from exc
    if len(data) > limit:
        raise StoreError(f"image {path.name}: larger than {limit} bytes")
    pos = MAGIC_BYTES
    records: list[dict[int, int]] = []
    while pos < len(data):
        if pos + 4 > len(data):
            raise StoreError(f"image {path.name}: cut short")
        size = int.from_bytes(data[pos:pos + 4], "little")
        pos += 4
        if pos + size > len(data):
            raise StoreError(f"image {path.name}: cut short")
        try:
            records.append(message_numbers(data[pos:pos + size]))
        except StoreError as exc:
            raise StoreError(f"image {path.name}: {exc}") from None
        pos += size
    return records


def read_pagemap(path: Path) -> list[PageRun]:
    """The present runs of one pagemap image, adjacent entries merged. Raises StoreError for
    an image it cannot read."""
    try:
        records = image_records(path)
    except StoreError as exc:
        raise StoreError(str(exc).replace("image ", "pagemap ", 1)) from None
    if not records or 1 not in records[0]:
        raise StoreError(f"pagemap {path.name}: no head")
    pages_file = f"pages-{records[0][1]}.img"
    runs: list[PageRun] = []
    offset = 0
    for entry in records[1:]:
        if not entry.get(4, 0) & PE_PRESENT:
            continue
        length = entry.get(5, entry.get(2, 0)) * PAGE
        vaddr = entry.get(1, 0)
        last = runs[-1] if runs else None
        if last is not None and last.vaddr + last.length == vaddr \
                and last.offset + last.length == offset:
            runs[-1] = PageRun(pages_file, last.vaddr, last.offset, last.length + length)
        else:
            runs.append(PageRun(pages_file, vaddr, offset, length))
        offset += length
    return runs


def small_runs(images: Path, budget: int) -> list[PageRun]:
    """The smallest runs of every process, smallest first, up to `budget` bytes in all: what a
    job touches first, not its bulk. Raises StoreError."""
    runs = [run for path in sorted(images.glob("pagemap-*.img")) for run in read_pagemap(path)]
    chosen: list[PageRun] = []
    total = 0
    for run in sorted(runs, key=lambda r: r.length):
        if total + run.length > budget:
            break
        chosen.append(run)
        total += run.length
    return chosen


def warm(images: Path, runs: list[PageRun]) -> int:
    """Ask the kernel to read `runs` into the page cache (POSIX_FADV_WILLNEED: reads are
    queued, nothing waits for them); returns the bytes asked for."""
    asked = 0
    by_file: dict[str, list[PageRun]] = {}
    for run in runs:
        by_file.setdefault(run.pages_file, []).append(run)
    for name, file_runs in by_file.items():
        try:
            fd = os.open(images / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            for run in sorted(file_runs, key=lambda r: r.offset):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, run.offset, run.length, os.POSIX_FADV_WILLNEED)
                    asked += run.length
        finally:
            os.close(fd)
    return asked
