"""oomguard.store.zstdframes: whole zstd frames told from torn ones by their structure, on real
zstd output (python-zstandard's, and the zstd tool's where it is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import zstandard

from oomguard.store.zstdframes import Torn, check_frames, frames_whole

DATA = os.urandom(300_000) + bytes(2_000_000) + bytes(range(256)) * 4000


def _compressed() -> dict[str, bytes]:
    found = {}
    for level in (1, 19):
        for checksum in (False, True):
            found[f"level {level}, checksum {checksum}"] = zstandard.ZstdCompressor(
                level=level, write_checksum=checksum).compress(DATA)
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    found["streamed, no content size"] = stream.compress(DATA) + stream.flush()
    found["two frames"] = found["level 1, checksum False"] + found["level 19, checksum True"]
    found["a skippable frame first"] = ((0x184D2A53).to_bytes(4, "little")
                                        + (5).to_bytes(4, "little") + b"hello"
                                        + found["level 1, checksum True"])
    found["nothing compressed"] = zstandard.ZstdCompressor().compress(b"")
    return found


@pytest.mark.parametrize(("name", "blob"), sorted(_compressed().items()))
def test_whole_frames_pass_and_every_cut_is_torn(tmp_path: Path, name: str, blob: bytes) -> None:
    path = tmp_path / "archive.tar.zst"
    path.write_bytes(blob)
    assert frames_whole(path), name
    cuts = {1, 4, 5, 9, len(blob) // 3, len(blob) // 2, len(blob) - 5, len(blob) - 1}
    if name == "two frames":
        cuts.discard(len(_compressed()["level 1, checksum False"]))
    for cut in sorted(c for c in cuts if 0 < c < len(blob)):
        path.write_bytes(blob[:cut])
        with pytest.raises(Torn):
            check_frames(path)
    path.write_bytes(blob + b"\0\0\0")  # not a frame after the last
    assert not frames_whole(path)


def test_what_is_not_zstd(tmp_path: Path) -> None:
    path = tmp_path / "archive.tar.zst"
    for blob in (b"", b"plain text, not compressed", b"\x28\xb5\x2f\xfd"):
        path.write_bytes(blob)
        assert not frames_whole(path), blob
    assert not frames_whole(tmp_path / "missing")


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd tool is not installed")
def test_the_zstd_tools_output(tmp_path: Path) -> None:
    raw = tmp_path / "data"
    raw.write_bytes(DATA)
    subprocess.run(["zstd", "-q", "-3", str(raw)], check=True)
    packed = tmp_path / "data.zst"
    assert frames_whole(packed)
    packed.write_bytes(packed.read_bytes()[:-4])  # its checksum cut off
    assert not frames_whole(packed)
