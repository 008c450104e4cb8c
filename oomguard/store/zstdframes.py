"""Whether a file holds whole zstd frames, told from the frames' own structure (RFC 8878) without
decompressing anything: an export cut short (its writer killed) ends inside a frame. Each
frame's header, then each block's 3-byte header, is read and the block's content skipped, so
the cost is one small read per 128 KiB block and no memory, however well the data compresses.
Standard library only."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

FRAME_MAGIC = 0xFD2FB528
SKIPPABLE_MAGIC = 0x184D2A50  # to 0x184D2A5F: a frame of user data, skipped
SKIPPABLE_MASK = 0xFFFFFFF0
RAW, RLE, COMPRESSED = 0, 1, 2
DICTIONARY_ID_BYTES = (0, 1, 2, 4)
CONTENT_SIZE_BYTES = (0, 2, 4, 8)  # by the header's flag (0: 1 byte for a single segment)


class Torn(Exception):
    """The data ends inside a frame, or is not zstd."""


def _read(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise Torn(f"ends {size - len(data)} bytes short")
    return data


def _skip(f: BinaryIO, size: int, end: int) -> None:
    if f.tell() + size > end:
        raise Torn("a block runs past the end")
    f.seek(size, os.SEEK_CUR)


def _frame(f: BinaryIO, end: int) -> None:
    """One zstd frame after its magic number."""
    descriptor = _read(f, 1)[0]
    single_segment = bool(descriptor & 0x20)
    if descriptor & 0x08:
        raise Torn("a frame header's reserved bit is set")
    checksum = bool(descriptor & 0x04)
    content_size = CONTENT_SIZE_BYTES[descriptor >> 6]
    if content_size == 0 and single_segment:
        content_size = 1
    header = (0 if single_segment else 1) + DICTIONARY_ID_BYTES[descriptor & 0x03] + content_size
    _skip(f, header, end)
    while True:
        raw = _read(f, 3)
        block = raw[0] | raw[1] << 8 | raw[2] << 16
        last, kind, size = block & 1, (block >> 1) & 3, block >> 3
        if kind == RLE:
            _skip(f, 1, end)
        elif kind in (RAW, COMPRESSED):
            _skip(f, size, end)
        else:
            raise Torn("a reserved block type")
        if last:
            break
    if checksum:
        _skip(f, 4, end)


def check_frames(path: Path) -> None:
    """Raises Torn unless the file is one or more whole zstd frames (skippable ones between
    them allowed); OSError where it cannot be read."""
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        if end == 0:
            raise Torn("empty")
        while f.tell() < end:
            (magic,) = struct.unpack("<I", _read(f, 4))
            if magic == FRAME_MAGIC:
                _frame(f, end)
            elif magic & SKIPPABLE_MASK == SKIPPABLE_MAGIC:
                (size,) = struct.unpack("<I", _read(f, 4))
                _skip(f, size, end)
            else:
                raise Torn(f"no zstd frame at byte {f.tell() - 4}")


def frames_whole(path: Path) -> bool:
    """Whether the file is whole zstd frames (False where it is torn or unreadable)."""
    try:
        check_frames(path)
    except (Torn, OSError):
        return False
    return True
