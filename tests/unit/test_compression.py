"""oomguard.store.compression, with the digester and the commit that use it, on real files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import zstandard

from oomguard.model.errors import StoreError
from oomguard.store.checkpoints import COMPRESSED, IMAGES, Store
from oomguard.store.compression import SAMPLE, Packer, PageCompressor, compressed_pages, expand
from oomguard.store.digest import Digests, ImageDigester, with_packed
from oomguard.store.integrity import XXH3, digest_file, find_sums, read_sums
from tests.unit.test_store import make_meta

TEXTLIKE = b"".join(bytes([i % 251]) * 4096 for i in range(1024))  # 4 MiB, like a hog's pages


def test_a_compressed_stream_expands_back_and_is_checked(tmp_path: Path) -> None:
    raw = tmp_path / "pages-1.img"
    raw.write_bytes(TEXTLIKE)
    packer = PageCompressor(raw, 3)
    for start in range(0, len(TEXTLIKE), 1 << 20):
        packer.feed(memoryview(TEXTLIKE)[start:start + (1 << 20)])
    assert packer.finish()
    stored = tmp_path / "pages-1.img.zst"
    assert stored.stat().st_size < len(TEXTLIKE) // 100
    assert zstandard.ZstdDecompressor().decompress(stored.read_bytes(),
                                                   max_output_size=1 << 30) == TEXTLIKE
    raw.unlink()
    digest = digest_file(stored, XXH3)
    assert expand(stored, digest, XXH3).read_bytes() == TEXTLIKE
    raw.unlink()
    with pytest.raises(StoreError, match=r"pages-1\.img\.zst checksum mismatch"):
        expand(stored, "0" * 32, XXH3)
    assert not raw.exists()  # nothing half expanded is left for CRIU
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"pages-1\.img\.zst (does not decompress|checksum)"):
        expand(stored, digest_file(stored, XXH3), XXH3)  # the frame's own checksum catches it
    assert not raw.exists()


def test_memory_that_does_not_compress_is_left_as_it_is(tmp_path: Path) -> None:
    raw = tmp_path / "pages-1.img"
    noise = os.urandom(SAMPLE + (1 << 20))
    packer = PageCompressor(raw, 1)
    for start in range(0, len(noise), 4 << 20):
        packer.feed(memoryview(noise)[start:start + (4 << 20)])
    assert packer.given_up and not packer.finish()
    assert not (tmp_path / "pages-1.img.zst").exists()


def _dump(images: Path, level: int, chunks: list[bytes]) -> Digests | None:
    """What CRIU does, roughly: pages appended while the digester and the packer follow;
    then what the checkpointer does once CRIU has exited."""
    (images / "pages-1.img").touch()
    digester = ImageDigester(images, XXH3, interval=0.001)
    digester.start()
    packer = Packer(images, level)

    def write() -> None:
        with open(images / "pages-1.img", "ab") as handle:
            for chunk in chunks:
                handle.write(chunk)
                handle.flush()
                time.sleep(0.002)
    writer = threading.Thread(target=write)
    writer.start()
    writer.join()
    (images / "core-1.img").write_bytes(b"core")
    return with_packed(digester.result(), *packer.finish())


def test_the_dump_compresses_as_it_goes_and_the_commit_swaps_the_files(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", algorithm=XXH3)
    images, lock = store.begin(make_meta("ck1"))
    os.close(lock)
    digests = _dump(images, 3, [TEXTLIKE] * 8)
    assert digests is not None and digests.compressed == {"pages-1.img": 8 * len(TEXTLIKE)}
    final = store.commit(make_meta("ck1"), digests)
    assert sorted(p.name for p in (final / IMAGES).iterdir()) == ["core-1.img",
                                                                  "pages-1.img.zst"]
    meta = store.get("ck1")
    assert meta.extra[COMPRESSED] == {"pages-1.img": 8 * len(TEXTLIKE)}
    assert meta.image_bytes < len(TEXTLIKE)
    sums = read_sums(find_sums(final)[0])
    assert sorted(sums) == ["core-1.img", "pages-1.img.zst"]
    store.verify("ck1")
    [stored] = compressed_pages(final / IMAGES)
    assert expand(stored, sums[stored.name], XXH3).read_bytes() == TEXTLIKE * 8


def test_incompressible_pages_stay_plain(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", algorithm=XXH3)
    images, lock = store.begin(make_meta("ck2"))
    os.close(lock)
    noise = [os.urandom(8 << 20) for _ in range(9)]  # past the 64 MiB sample
    digests = _dump(images, 1, noise)
    assert digests is not None and digests.compressed == {}
    final = store.commit(make_meta("ck2"), digests)
    assert sorted(p.name for p in (final / IMAGES).iterdir()) == ["core-1.img", "pages-1.img"]
    assert COMPRESSED not in store.get("ck2").extra


def test_a_crash_leaves_the_plain_pages_and_recovery_drops_the_half_stream(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "store", algorithm=XXH3)
    images, lock = store.begin(make_meta("ck3"))
    os.close(lock)
    (images / "pages-1.img").write_bytes(TEXTLIKE)
    (images / "pages-1.img.zst").write_bytes(b"half a stream")
    (images / "dump.log").write_text("(00.1) Dumping finished successfully\n")
    assert store.recover_partials() == [("ck3", "completed")]
    assert sorted(p.name for p in store.images_of("ck3").iterdir()) == ["dump.log",
                                                                       "pages-1.img"]
    store.verify("ck3")


def test_an_abandoned_dump_leaves_no_compressed_pages(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(TEXTLIKE)
    packer = Packer(tmp_path, 3)
    time.sleep(0.05)
    packer.abandon()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pages-1.img"]
