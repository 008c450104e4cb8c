"""oomguard.store.pagemap: CRIU's pagemap images read into runs of pages (images made here byte
by byte, as criu/pagemap.c writes them), and the page cache warmed with the small ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.model.errors import StoreError
from oomguard.store.pagemap import PAGE, PE_PRESENT, PageRun, read_pagemap, small_runs, warm
from tests.helpers import wait_until

MAGIC = (0x54564319).to_bytes(4, "little") + (0x56084025).to_bytes(4, "little")
PARENT = 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _message(*fields: tuple[int, int]) -> bytes:
    return b"".join(_varint(number << 3) + _varint(value) for number, value in fields)


def _record(message: bytes) -> bytes:
    return len(message).to_bytes(4, "little") + message


def _pagemap(pages_id: int, entries: list[tuple[int, int, int]], compat: bool = False) -> bytes:
    """entries: (vaddr, pages, flags)."""
    body = _record(_message((1, pages_id)))
    for vaddr, pages, flags in entries:
        count = (2, pages) if compat else (5, pages)
        body += _record(_message((1, vaddr), (2, 0) if not compat else count, (4, flags),
                                 *([count] if not compat else [])))
    return MAGIC + body


def test_adjacent_present_entries_make_one_run_and_absent_ones_take_no_bytes(
        tmp_path: Path) -> None:
    path = tmp_path / "pagemap-7.img"
    path.write_bytes(_pagemap(3, [
        (0x10000, 2, PE_PRESENT), (0x12000, 256, PE_PRESENT),  # one run: 258 pages
        (0x200000, 5, PARENT),  # in a parent image: no bytes here
        (0x300000, 1, PE_PRESENT),
        (0x301000, 4, PE_PRESENT | 2),  # adjacent: merged (lazy flag or not)
        (0x400000, 3, PE_PRESENT)]))
    assert read_pagemap(path) == [
        PageRun("pages-3.img", 0x10000, 0, 258 * PAGE),
        PageRun("pages-3.img", 0x300000, 258 * PAGE, 5 * PAGE),
        PageRun("pages-3.img", 0x400000, 263 * PAGE, 3 * PAGE)]


def test_older_images_count_their_pages_in_the_compat_field(tmp_path: Path) -> None:
    path = tmp_path / "pagemap-1.img"
    path.write_bytes(_pagemap(1, [(0x1000, 4, PE_PRESENT), (0x9000, 2, PE_PRESENT)],
                              compat=True))
    assert [(r.offset, r.length) for r in read_pagemap(path)] == [(0, 4 * PAGE),
                                                                  (4 * PAGE, 2 * PAGE)]


@pytest.mark.parametrize("damage", [
    lambda data: data[:-3],  # a record cut short
    lambda data: data[:8] + (1000).to_bytes(4, "little") + data[12:],  # a length past the end
    lambda data: MAGIC + _record(bytes([0x0B, 1])),  # wire type 3 (a group): never written
    lambda data: MAGIC + _record(bytes([0x08, 0x80])),  # a number with no last byte
    lambda data: MAGIC,  # no head
])
def test_a_pagemap_it_cannot_read_is_a_store_error(tmp_path: Path, damage: object) -> None:
    path = tmp_path / "pagemap-1.img"
    path.write_bytes(damage(_pagemap(1, [(0x1000, 1, PE_PRESENT)])))  # type: ignore[operator]
    with pytest.raises(StoreError, match="pagemap"):
        read_pagemap(path)


def test_the_smallest_runs_of_every_process_are_chosen_within_the_budget(
        tmp_path: Path) -> None:
    (tmp_path / "pagemap-1.img").write_bytes(_pagemap(1, [
        (0x1000, 1, PE_PRESENT), (0x100000, 1000, PE_PRESENT), (0x900000, 3, PE_PRESENT)]))
    (tmp_path / "pagemap-2.img").write_bytes(_pagemap(2, [(0x1000, 2, PE_PRESENT)]))
    assert [(r.pages_file, r.length // PAGE) for r in small_runs(tmp_path, 6 * PAGE)] == [
        ("pages-1.img", 1), ("pages-2.img", 2), ("pages-1.img", 3)]
    assert len(small_runs(tmp_path, 1006 * PAGE)) == 4
    assert small_runs(tmp_path, 0) == []


def test_warming_brings_the_runs_into_the_page_cache(tmp_path: Path) -> None:
    # On the disk (tmpfs keeps everything in memory and has no RWF_NOWAIT).
    images = Path("/var/tmp") / f"oomguard-test-pagemap-{os.getpid()}"
    images.mkdir()
    try:
        pages = images / "pages-1.img"
        pages.write_bytes(os.urandom(64 * PAGE))
        fd = os.open(pages, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            runs = [PageRun("pages-1.img", 0x1000, 8 * PAGE, 4 * PAGE),
                    PageRun("pages-1.img", 0x9000, 40 * PAGE, 2 * PAGE),
                    PageRun("pages-9.img", 0x1000, 0, PAGE)]  # no such file: skipped

            def cached() -> bool:
                try:
                    return all(os.preadv(fd, [bytearray(r.length)], r.offset, os.RWF_NOWAIT)
                               == r.length for r in runs[:2])
                except BlockingIOError:
                    return False
            # Pages still in another CPU's LRU batch survive one DONTNEED: asked again.
            assert wait_until(lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                              or not cached(), 5)
            assert warm(images, runs) == 6 * PAGE
            assert wait_until(cached, 5)
        finally:
            os.close(fd)
    finally:
        for path in images.iterdir():
            path.unlink()
        images.rmdir()
