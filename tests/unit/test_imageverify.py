"""oomguard.store.verify: the checks of a restore, on real files (the page cache included)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from oomguard.model.errors import StoreError
from oomguard.store.criu_hook import REPLY_OK, VERIFY_GATE_ENV, answer, ask
from oomguard.store.integrity import SHA256, XXH3, compute
from oomguard.store.verify import GATE_NAME, RestoreVerifier

PAGES = bytes(range(256)) * 4096 * 3  # 3 MiB


def _images(tmp_path: Path) -> Path:
    images = tmp_path / "ckpt" / "images"
    images.mkdir(parents=True)
    (images / "pages-1.img").write_bytes(PAGES)
    (images / "pages-2.img").write_bytes(PAGES[::-1])
    (images / "core-1.img").write_bytes(b"core")
    (images / "pagemap-1.img").write_bytes(b"map")
    (images / "dump.log").write_text("log")
    return images


def _verifier(images: Path, algorithm: str = XXH3) -> RestoreVerifier:
    return RestoreVerifier(images, algorithm, compute(images, algorithm), "XXH128SUMS")


def _uncache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("algorithm", [XXH3, SHA256])
def test_intact_pages_followed_from_the_cache(tmp_path: Path, algorithm: str) -> None:
    verifier = _verifier(_images(tmp_path), algorithm)
    verifier.check_upfront()
    assert verifier.follow_pages(lambda: False, lambda: False) == []
    assert verifier.pages_bytes == 2 * len(PAGES)


def test_pages_not_in_the_cache_are_read_once_criu_has_read_everything(tmp_path: Path) -> None:
    images = _images(tmp_path)
    verifier = _verifier(images)
    for path in images.glob("pages-*.img"):
        _uncache(path)
    asked = time.monotonic() + 0.2  # "the post-restore action asks" 0.2 s from now
    assert verifier.follow_pages(lambda: False, lambda: time.monotonic() > asked) == []


def test_a_damaged_pages_file_is_named(tmp_path: Path) -> None:
    images = _images(tmp_path)
    verifier = _verifier(images)
    with (images / "pages-2.img").open("r+b") as handle:
        handle.seek(len(PAGES) - 100)
        handle.write(b"\xff")
    assert verifier.follow_pages(lambda: False, lambda: True) == ["pages-2.img checksum mismatch"]


def test_a_truncated_pages_file_is_named(tmp_path: Path) -> None:
    images = _images(tmp_path)
    verifier = _verifier(images)
    os.truncate(images / "pages-1.img", 4096)
    assert verifier.follow_pages(lambda: False, lambda: True) == ["pages-1.img checksum mismatch"]


def test_upfront_names_every_small_problem_and_reads_no_pages(tmp_path: Path) -> None:
    images = _images(tmp_path)
    verifier = _verifier(images)
    (images / "core-1.img").write_bytes(b"CORE")
    (images / "pages-1.img").write_bytes(b"damaged pages are not looked at upfront")
    (images / "pagemap-1.img").unlink()
    (images / "extra.img").write_bytes(b"")
    with pytest.raises(StoreError) as caught:
        verifier.check_upfront()
    assert str(caught.value) == ("checkpoint is damaged: pagemap-1.img missing; extra.img not "
                                 "in XXH128SUMS; core-1.img checksum mismatch")
    assert verifier.pages_bytes == 0


@pytest.mark.parametrize(("damage", "verdict"), [(False, REPLY_OK),
                                                 (True, "damaged: pages-1.img checksum mismatch")])
def test_the_post_restore_action_gets_the_verdict(tmp_path: Path, damage: bool,
                                                  verdict: str) -> None:
    images = _images(tmp_path)
    verifier = _verifier(images)
    if damage:
        (images / "pages-1.img").write_bytes(b"x" * len(PAGES))
    verifier.start(images.parent)
    base = verifier.gate_env()[VERIFY_GATE_ENV]
    assert base == str(images.parent / GATE_NAME)
    reply = ask(base, "verdict")  # what criu_hook's post-restore does
    assert reply is not None and answer(reply, 10.0) == verdict
    report = verifier.finish()
    assert report.finished and (report.problems != ()) == damage
    assert not list(images.parent.glob(f"{GATE_NAME}.*"))


def test_stopped_before_criu_read_anything(tmp_path: Path) -> None:
    verifier = _verifier(_images(tmp_path))
    assert verifier.follow_pages(lambda: True, lambda: False) == []  # CRIU failed at once
    report = verifier.finish(cancel=True)
    assert not report.finished and report.problems == () and report.pages_bytes == 0


def test_check_pages_reads_everything_itself(tmp_path: Path) -> None:
    """What a lazy restore's keeper does: no CRIU reads for it."""
    images = _images(tmp_path)
    verifier = _verifier(images)
    for path in images.glob("pages-*.img"):
        _uncache(path)
    assert verifier.check_pages() == []
    (images / "pages-1.img").write_bytes(b"")
    assert _verifier(images).check_pages() == []
    assert verifier.check_pages() == ["pages-1.img checksum mismatch"]


def test_a_file_system_without_rwf_nowait_is_read_outright(tmp_path: Path) -> None:
    """tmpfs answers RWF_NOWAIT with EOPNOTSUPP (a store there: the commit-failure test's)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir=shm) as where:
        images = _images(Path(where))
        assert _verifier(images).follow_pages(lambda: False, lambda: False) == []


def test_a_verifier_that_breaks_never_says_ok(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    images = _images(tmp_path)
    verifier = _verifier(images)

    def broken(*_: object) -> list[str]:
        raise ValueError("filedescriptor out of range in select()")

    monkeypatch.setattr(verifier, "follow_pages", broken)
    verifier.start(images.parent)
    reply = ask(verifier.gate_env()[VERIFY_GATE_ENV], "verdict")
    assert reply is not None
    verdict = answer(reply, 10.0)
    assert verdict is not None and verdict != REPLY_OK and "not verified" in verdict
    assert verifier.finish().problems


def _cached(path: Path, offset: int) -> bool:
    """Is the block at `offset` in the page cache (a read that may not wait for the disk)?"""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], offset, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _half_cached(tmp_path: Path) -> Path:
    """A pages file of 3 MiB whose first MiB alone is in the page cache."""
    images = _images(tmp_path)
    (images / "pages-2.img").unlink()  # one file is enough
    path = images / "pages-1.img"
    _uncache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
        os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    if _cached(path, len(PAGES) - 4096):
        pytest.skip("the page cache kept what was dropped (a file system without a disk)")
    return path


def _follow_until_stuck(verifier: RestoreVerifier) -> None:
    looks = iter(range(200))  # 200 looks, about 0.2 s: no page comes in by itself meanwhile
    verifier.follow_pages(lambda: next(looks, None) is None, lambda: False)


def test_reads_are_asked_for_ahead_of_what_criu_read(tmp_path: Path) -> None:
    """The eager restore's verifier asks for the pages past its position (CRIU reads them
    next): the rest of the file comes into the cache without CRIU."""
    path = _half_cached(tmp_path)
    images = path.parent
    verifier = RestoreVerifier(images, XXH3, compute(images, XXH3), "XXH128SUMS")
    _follow_until_stuck(verifier)
    deadline = time.monotonic() + 10
    while not _cached(path, len(PAGES) - 4096) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _cached(path, len(PAGES) - 4096)


def test_with_no_reads_ahead_nothing_is_asked_for(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The lazy keeper's verifier (ahead=0) asks for no reads past its position while CRIU's
    lazy-pages daemon serves the job (reads queued ahead of the daemon's delay the job's
    faults); it still hashes every page (a miss starts at most the kernel's own readahead)."""
    path = _half_cached(tmp_path)
    images = path.parent
    asked: list[int] = []
    fadvise = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append(offset)
        fadvise(fd, offset, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", spy)
    verifier = RestoreVerifier(images, XXH3, compute(images, XXH3), "XXH128SUMS", ahead=0)
    assert verifier.follow_pages(lambda: False, lambda: True) == []
    assert verifier.pages_bytes == len(PAGES) and asked == []
    default = RestoreVerifier(images, XXH3, compute(images, XXH3), "XXH128SUMS")
    _uncache(path)
    assert default.follow_pages(lambda: False, lambda: True) == []
    assert asked  # the eager restore's verifier does ask


def test_every_pages_file_is_closed_once_followed(tmp_path: Path) -> None:
    """A pages file kept open by the daemon after its restore keeps a pruned checkpoint's
    blocks on the disk (the store's budget frees nothing): none is left open."""
    images = _images(tmp_path)

    def open_pages() -> list[str]:
        names = (os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{fd}"))
        return [name for name in names if name.startswith(str(images))]

    assert _verifier(images).follow_pages(lambda: False, lambda: True) == []
    assert open_pages() == []
