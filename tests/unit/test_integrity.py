"""oomguard.store.integrity: SHA256SUMS of a checkpoint's images, written and verified on real files."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from oomguard.model.errors import StoreError
from oomguard.store.integrity import (
    CHECKSUMS,
    SHA256,
    SUMS_FILES,
    XXH3,
    compute,
    find_sums,
    format_sums,
    image_files,
    parse_sums,
    read_sums,
    verify,
)

IMAGE_FILES = {
    "pages-1.img": b"\x00\x01page data" * 300,
    "pagemap-1.img": b"pagemap",
    "core-1.img": b"",  # an empty image is still an image
    "inventory.img": bytes(range(256)),
    "name with spaces.img": b"spaces survive",
}
DIGEST_A = "a" * 64


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """A checkpoint directory's images/ with a few image files and CRIU logs beside them."""
    path = tmp_path / "ckpt" / "images"
    path.mkdir(parents=True)
    for name, data in IMAGE_FILES.items():
        (path / name).write_bytes(data)
    (path / "dump.log").write_text("(00.1) Dumping finished successfully\n")
    (path / "stats-dump.log").write_text("x")
    return path


def _write_sums(images: Path) -> Path:
    sums = images.parent / CHECKSUMS  # where the store keeps it: beside images/
    sums.write_text(format_sums(compute(images)))
    return sums


def _damage(images: Path, sums: Path) -> str:
    with pytest.raises(StoreError) as caught:
        verify(images, sums)
    return str(caught.value)


# -- compute / format / parse --------------------------------------------------------------------

def test_compute_digests_every_image_but_not_logs(images: Path) -> None:
    assert compute(images) == {name: _sha(data) for name, data in IMAGE_FILES.items()}


def test_image_files_skip_logs_directories_and_symlinks(images: Path) -> None:
    (images / "subdir").mkdir()
    (images / "subdir" / "x.img").write_bytes(b"x")
    (images / "link.img").symlink_to(images / "pages-1.img")
    (images / "restore.log").write_text("later")
    assert [p.name for p in image_files(images)] == sorted(IMAGE_FILES)


def test_round_trip(images: Path) -> None:
    sums = compute(images)
    text = format_sums(sums)
    assert parse_sums(text) == sums
    assert text.endswith("\n")
    lines = text.splitlines()
    assert [line.split("  ", 1)[1] for line in lines] == sorted(IMAGE_FILES)  # sorted by name
    assert all(re.fullmatch(r"[0-9a-f]{64}  \S.*", line) for line in lines)


def test_format_of_nothing_is_empty_and_parses_back() -> None:
    assert format_sums({}) == ""
    assert parse_sums("") == {}


def test_verify_passes_on_intact_images(images: Path) -> None:
    sums = _write_sums(images)
    verify(images, sums)
    # logs may change or vanish after the checkpoint: they are not state
    (images / "dump.log").write_text("rewritten")
    (images / "stats-dump.log").unlink()
    (images / "restore.log").write_text("new")
    verify(images, sums)


def test_sha256sum_accepts_our_format(images: Path) -> None:
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum (coreutils) is not installed")
    sums = _write_sums(images)
    inside = images / CHECKSUMS  # `sha256sum -c SHA256SUMS` from inside images/
    shutil.copyfile(sums, inside)
    try:
        done = subprocess.run(["sha256sum", "--strict", "-c", CHECKSUMS], cwd=images,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(done.stdout.splitlines()) == sorted(f"{n}: OK" for n in IMAGE_FILES)
        (images / "pagemap-1.img").write_bytes(b"altered")
        done = subprocess.run(["sha256sum", "-c", CHECKSUMS], cwd=images,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 1
        assert "pagemap-1.img: FAILED" in done.stdout
    finally:
        inside.unlink()


def test_we_accept_what_sha256sum_writes(images: Path) -> None:
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum (coreutils) is not installed")
    names = sorted(IMAGE_FILES)
    done = subprocess.run(["sha256sum", "--", *names], cwd=images, capture_output=True,
                          text=True, timeout=30, check=True)
    assert parse_sums(done.stdout) == compute(images)
    sums = images.parent / CHECKSUMS
    sums.write_text(done.stdout)
    verify(images, sums)


# -- verify: what is wrong, all of it at once ------------------------------------------------------

def test_verify_names_a_missing_file(images: Path) -> None:
    sums = _write_sums(images)
    (images / "pages-1.img").unlink()
    assert _damage(images, sums) == "checkpoint is damaged: pages-1.img missing"


def test_verify_names_an_extra_file(images: Path) -> None:
    sums = _write_sums(images)
    (images / "ghost.img").write_bytes(b"boo")
    assert _damage(images, sums) == f"checkpoint is damaged: ghost.img not in {CHECKSUMS}"


@pytest.mark.parametrize("altered", [b"\x01\x01page data", b"", b"\x00\x01page data" * 301])
def test_verify_names_an_altered_file(images: Path, altered: bytes) -> None:
    sums = _write_sums(images)
    (images / "pages-1.img").write_bytes(altered)
    assert _damage(images, sums) == "checkpoint is damaged: pages-1.img checksum mismatch"


def test_verify_one_flipped_bit_is_caught(images: Path) -> None:
    sums = _write_sums(images)
    target = images / "inventory.img"
    data = bytearray(target.read_bytes())
    data[100] ^= 0x04
    target.write_bytes(bytes(data))
    assert "inventory.img checksum mismatch" in _damage(images, sums)


def test_verify_reports_every_problem_at_once(images: Path) -> None:
    sums = _write_sums(images)
    (images / "pages-1.img").unlink()
    (images / "core-1.img").unlink()
    (images / "ghost.img").write_bytes(b"boo")
    (images / "zz-extra.img").write_bytes(b"")
    (images / "inventory.img").write_bytes(b"changed")
    (images / "pagemap-1.img").write_bytes(b"changed too")
    message = _damage(images, sums)
    assert message == (
        "checkpoint is damaged: core-1.img missing; pages-1.img missing; "
        f"ghost.img not in {CHECKSUMS}; zz-extra.img not in {CHECKSUMS}; "
        "inventory.img checksum mismatch; pagemap-1.img checksum mismatch")


def test_verify_a_file_replaced_by_a_directory_is_missing(images: Path) -> None:
    sums = _write_sums(images)
    (images / "core-1.img").unlink()
    (images / "core-1.img").mkdir()
    assert _damage(images, sums) == "checkpoint is damaged: core-1.img missing"


def test_verify_without_sums_file(images: Path) -> None:
    assert _damage(images, images.parent / CHECKSUMS) == (
        f"checkpoint has no {CHECKSUMS}: cannot verify its images")


def test_verify_with_a_malformed_sums_file(images: Path) -> None:
    sums = images.parent / CHECKSUMS
    good = format_sums(compute(images)).splitlines()
    sums.write_text("\n".join([good[0], good[1], "garbage", *good[2:]]) + "\n")
    assert _damage(images, sums) == f"{CHECKSUMS} line 3 is malformed"


def test_verify_with_undecodable_sums_file(images: Path) -> None:
    sums = _write_sums(images)
    sums.write_bytes(b"\xff\xfe" + sums.read_bytes())
    _damage(images, sums)


def test_verify_with_empty_sums_file_flags_every_image(images: Path) -> None:
    sums = images.parent / CHECKSUMS
    sums.write_text("")
    message = _damage(images, sums)
    for name in IMAGE_FILES:
        assert f"{name} not in {CHECKSUMS}" in message


# -- parse_sums: malformed lines --------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("a" * 63 + "  x.img\n", 1),  # digest too short
        ("a" * 65 + "  x.img\n", 1),  # digest too long
        ("  x.img\n", 1),  # no digest
        (DIGEST_A + " x.img\n", 1),  # single space
        (DIGEST_A + "\tx.img\n", 1),  # tab, no double space
        (DIGEST_A + "x.img\n", 1),  # no separator
        (DIGEST_A + "  \n", 1),  # no name
        (DIGEST_A + "\n", 1),  # digest alone
        (DIGEST_A + "  ../x.img\n", 1),  # a path, not a name
        (DIGEST_A + "  sub/x.img\n", 1),
        (DIGEST_A + "  /etc/passwd\n", 1),
        (f"{DIGEST_A}  ok.img\n{DIGEST_A}  dir/x.img\n", 2),
        (f"{DIGEST_A}  a.img\n{DIGEST_A}  b.img\nnonsense\n", 3),
        (f"{DIGEST_A}  a.img\n\n{DIGEST_A}  b.img\n", 2),  # an empty line
        (f"{DIGEST_A}  a.img\n{'b' * 63}  b.img\n", 2),
    ],
    ids=["short-digest", "long-digest", "no-digest", "one-space", "tab", "no-separator",
         "no-name", "digest-only", "dotdot", "subdir", "absolute", "slash-line-2", "garbage-line-3",
         "empty-line-2", "short-digest-line-2"],
)
def test_parse_sums_malformed(text: str, line: int) -> None:
    with pytest.raises(StoreError) as caught:
        parse_sums(text)
    assert str(caught.value) == f"{CHECKSUMS} line {line} is malformed"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"{DIGEST_A}  x.img\n", {"x.img": DIGEST_A}),
        (f"{DIGEST_A}  x.img", {"x.img": DIGEST_A}),  # no final newline
        (f"{DIGEST_A}  x.img\r\n", {"x.img": DIGEST_A}),
        (f"{DIGEST_A}  two  spaces.img\n", {"two  spaces.img": DIGEST_A}),  # split once
        (f"{DIGEST_A}  a.img\n{'b' * 64}  b.img\n", {"a.img": DIGEST_A, "b.img": "b" * 64}),
    ],
    ids=["plain", "no-final-newline", "crlf", "double-space-in-name", "two-lines"],
)
def test_parse_sums_valid(text: str, expected: dict[str, str]) -> None:
    assert parse_sums(text) == expected


def test_compute_leaves_files_untouched(images: Path) -> None:
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in images.iterdir()}
    compute(images)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in images.iterdir()} == before
    assert os.listdir(images.parent) == ["images"]


# -- XXH3-128 (XXH128SUMS), the default of new checkpoints ------------------------------------------

def test_xxh3_sums_round_trip_and_verify(images: Path) -> None:
    import xxhash

    sums = compute(images, XXH3)
    assert sums["inventory.img"] == xxhash.xxh3_128(IMAGE_FILES["inventory.img"]).hexdigest()
    path = images.parent / SUMS_FILES[XXH3]
    path.write_text(format_sums(sums))
    assert find_sums(images.parent) == (path, XXH3)  # preferred over a SHA256SUMS beside it
    assert read_sums(path) == sums
    verify(images, path)
    (images / "pagemap-1.img").write_bytes(b"altered")
    with pytest.raises(StoreError, match=r"pagemap-1\.img checksum mismatch"):
        verify(images, path)


def test_xxh3_sums_have_32_hex_digits() -> None:
    assert parse_sums(f"{'a' * 32}  x.img\n", "XXH128SUMS") == {"x.img": "a" * 32}
    with pytest.raises(StoreError, match="XXH128SUMS line 1 is malformed"):
        parse_sums(f"{DIGEST_A}  x.img\n", "XXH128SUMS")


def test_a_checkpoint_without_sums_names_sha256sums() -> None:
    assert find_sums(Path("/nonexistent")) == (Path("/nonexistent") / CHECKSUMS, SHA256)


def test_xxh128sum_accepts_our_format(images: Path) -> None:
    if shutil.which("xxh128sum") is None:
        pytest.skip("xxh128sum (the xxhash package's tool) is not installed")
    (images / SUMS_FILES[XXH3]).write_text(format_sums(compute(images, XXH3)))
    done = subprocess.run(["xxh128sum", "-c", SUMS_FILES[XXH3]], cwd=images,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
