"""Checksums taken while CRIU writes (oomguard.store.digest), the gate to CRIU's action script
(oomguard.store.hookgate + criu_hook.ask/answer) and the commit that uses them, on real files."""

from __future__ import annotations

import ast
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from oomguard.model.errors import StoreError
from oomguard.store import criu_hook, integrity
from oomguard.store.checkpoints import IMAGES, PARTIAL_PREFIX, Store
from oomguard.store.criu_hook import REPLY_OK, answer, ask
from oomguard.store.digest import GATE_NAME, Digests, FileDigest, ImageDigester
from oomguard.store.hookgate import Gate, remove_gates
from oomguard.store.integrity import SHA256, XXH3, digest_file, find_sums, read_sums
from oomguard.store.names import CHECKPOINT_LOCK
from tests.unit.test_store import make_meta

ALGORITHMS = [SHA256, XXH3]


# -- the gate ------------------------------------------------------------------------------------

def test_gate_request_and_reply_round_trip(tmp_path: Path) -> None:
    with Gate(tmp_path, ".g") as gate:
        assert stat.S_ISFIFO((tmp_path / ".g.req").lstat().st_mode)
        assert stat.S_ISFIFO((tmp_path / ".g.ack").lstat().st_mode)
        assert gate.request(0.0) is None
        reply = ask(str(gate.base), "finish")
        assert reply is not None
        assert gate.request(1.0) == "finish"
        gate.reply("ok in 0.1 s")
        assert answer(reply, 1.0) == "ok in 0.1 s"
    assert list(tmp_path.iterdir()) == []  # the FIFOs go with the gate


def test_a_reply_written_before_the_question_waits_in_the_fifo(tmp_path: Path) -> None:
    with Gate(tmp_path, ".g") as gate:
        gate.reply(REPLY_OK)
        reply = ask(str(gate.base), "verdict")
        assert reply is not None and answer(reply, 1.0) == REPLY_OK


def test_nobody_listening_is_no_answer_at_once(tmp_path: Path) -> None:
    assert ask(str(tmp_path / ".nothing"), "finish") is None
    os.mkfifo(tmp_path / ".dead.req")  # left by an oomguard that died: no reader
    os.mkfifo(tmp_path / ".dead.ack")
    start = time.monotonic()
    assert ask(str(tmp_path / ".dead"), "finish") is None
    assert time.monotonic() - start < 1.0


def test_a_regular_file_is_not_a_gate(tmp_path: Path) -> None:
    (tmp_path / ".g.req").write_text("")
    assert ask(str(tmp_path / ".g"), "finish") is None


def test_oomguard_dying_while_the_script_waits_is_a_hang_up(tmp_path: Path) -> None:
    gate = Gate(tmp_path, ".g")
    reply = ask(str(gate.base), "verdict")
    assert reply is not None
    threading.Timer(0.2, gate.close).start()
    start = time.monotonic()
    assert answer(reply, 10.0) is None
    assert time.monotonic() - start < 5.0


def test_no_reply_times_out(tmp_path: Path) -> None:
    with Gate(tmp_path, ".g") as gate:
        reply = ask(str(gate.base), "verdict")
        assert reply is not None
        assert answer(reply, 0.1) is None


def test_gate_replaces_a_planted_symlink_without_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / ".g.req").symlink_to(victim)
    with Gate(tmp_path, ".g"):
        assert stat.S_ISFIFO((tmp_path / ".g.req").lstat().st_mode)
    assert victim.read_text() == "keep"


def test_remove_gates_removes_only_fifos(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ".digest.req")
    os.mkfifo(tmp_path / ".digest.ack")
    (tmp_path / "meta.ack").write_text("a regular file with that ending stays")
    remove_gates(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.ack"]


# -- the digester --------------------------------------------------------------------------------

def _writer(path: Path, chunks: int, size: int, pause: float) -> threading.Thread:
    def write() -> None:
        with open(path, "ab") as handle:
            for index in range(chunks):
                handle.write(bytes([index % 251]) * size)
                handle.flush()
                time.sleep(pause)
    return threading.Thread(target=write)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_follows_a_growing_pages_file_and_finishes_at_the_hooks_request(
        tmp_path: Path, algorithm: str) -> None:
    images = tmp_path / "ckpt" / IMAGES
    images.mkdir(parents=True)
    pages = images / "pages-1.img"
    pages.touch()
    digester = ImageDigester.following(images, algorithm)
    writer = _writer(pages, 40, 256 << 10, 0.005)
    writer.start()
    writer.join()
    (images / "core-1.img").write_bytes(b"core")  # small images: hashed at the finish
    (images / "dump.log").write_text("not state")
    time.sleep(0.05)
    reply = ask(str(images.parent / GATE_NAME), "finish")  # what the post-dump action does
    assert reply is not None
    assert (answer(reply, 10.0) or "").startswith("ok")
    (images / "stats-dump").write_bytes(b"written after post-dump")
    digests = digester.result()
    assert digests is not None and digests.at_post_dump and digests.algorithm == algorithm
    assert sorted(digests.files) == ["core-1.img", "pages-1.img"]
    for name, taken in digests.files.items():
        assert taken.digest == digest_file(images / name, algorithm)
        assert taken.matches((images / name).stat())
    assert digests.followed_bytes > 0  # hashed while it was written, not only at the end
    assert not any(p.name.startswith(GATE_NAME) for p in images.parent.iterdir())


def test_without_the_hooks_request_it_finishes_after_criu(tmp_path: Path) -> None:
    images = tmp_path / IMAGES
    images.mkdir()
    digester = ImageDigester(images, XXH3)  # no gate at all
    digester.start()
    (images / "pages-1.img").write_bytes(b"p" * 100_000)
    (images / "pagemap-1.img").write_bytes(b"m")
    digests = digester.result()
    assert digests is not None and not digests.at_post_dump
    assert digests.files["pages-1.img"].digest == digest_file(images / "pages-1.img", XXH3)


def test_a_file_replaced_after_it_was_followed_is_hashed_anew(tmp_path: Path) -> None:
    images = tmp_path / IMAGES
    images.mkdir()
    pages = images / "pages-1.img"
    pages.write_bytes(b"old" * 1000)
    digester = ImageDigester(images, SHA256, interval=0.001)
    digester.start()
    time.sleep(0.05)
    replacement = images / "new"
    replacement.write_bytes(b"new" * 1000)
    replacement.replace(pages)
    digests = digester.result()
    assert digests is not None
    assert digests.files["pages-1.img"].digest == digest_file(pages, SHA256)


def test_a_failing_digester_gives_no_digests(tmp_path: Path) -> None:
    images = tmp_path / IMAGES
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"x")
    digester = ImageDigester(images, SHA256)
    digester.start()
    images.rename(tmp_path / "gone")  # images/ vanished: nothing to digest
    assert digester.result() is None


# -- the commit ----------------------------------------------------------------------------------

def _partial(store: Store, checkpoint_id: str, files: dict[str, bytes]) -> Path:
    images, lock_fd = store.begin(make_meta(checkpoint_id))
    os.close(lock_fd)
    for name, data in files.items():
        (images / name).write_bytes(data)
    return images


def _digests(images: Path, algorithm: str, at_post_dump: bool = True) -> Digests:
    files = {}
    for path in integrity.image_files(images):
        st = path.stat()
        files[path.name] = FileDigest(digest_file(path, algorithm), st.st_size, st.st_mtime_ns,
                                      st.st_ino)
    return Digests(algorithm, files, at_post_dump, 0.0, 0)


def test_commit_takes_the_digests_and_reads_only_what_they_do_not_cover(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "store", algorithm=XXH3)
    images = _partial(store, "ck1", {"pages-1.img": b"p" * 50_000, "core-1.img": b"c"})
    digests = _digests(images, XXH3)
    (images / "stats-dump").write_bytes(b"after post-dump")
    read: list[str] = []
    synced: list[str] = []
    real_digest, real_sync = digest_file, os.fdatasync
    monkeypatch.setattr("oomguard.store.commit.digest_file",
                        lambda path, *a, **k: read.append(path.name) or real_digest(path, *a, **k))
    monkeypatch.setattr(os, "fdatasync",
                        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or
                        real_sync(fd))
    final = store.commit(make_meta("ck1"), digests)
    assert read == ["stats-dump"]
    assert [Path(p).name for p in synced] == ["stats-dump"]
    path, algorithm = find_sums(final)
    assert (path.name, algorithm) == ("XXH128SUMS", XXH3)
    assert read_sums(path) == {p.name: digest_file(p, XXH3)
                               for p in integrity.image_files(final / IMAGES)}
    store.verify("ck1")


def test_commit_rehashes_a_file_changed_since_its_digest(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", algorithm=SHA256)
    images = _partial(store, "ck2", {"pages-1.img": b"p" * 5000})
    digests = _digests(images, SHA256)
    (images / "pages-1.img").write_bytes(b"q" * 5001)
    store.commit(make_meta("ck2"), digests)
    store.verify("ck2")


def test_commit_ignores_digests_of_another_algorithm(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", algorithm=SHA256)
    images = _partial(store, "ck3", {"pages-1.img": b"p" * 5000})
    bogus = _digests(images, XXH3)
    final = store.commit(make_meta("ck3"), bogus)
    assert find_sums(final)[1] == SHA256
    store.verify("ck3")


def test_commit_without_post_dump_sync_syncs_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "store", algorithm=XXH3)
    images = _partial(store, "ck4", {"pages-1.img": b"p" * 5000, "core-1.img": b"c"})
    digests = _digests(images, XXH3, at_post_dump=False)
    synced: list[int] = []
    real_sync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd) or real_sync(fd))
    store.commit(make_meta("ck4"), digests)
    assert len(synced) == 2


def test_commit_removes_a_dead_gates_fifos_and_another_versions_sums(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", algorithm=XXH3)
    images = _partial(store, "ck5", {"pages-1.img": b"p"})
    os.mkfifo(images.parent / f"{GATE_NAME}.req")
    (images.parent / "SHA256SUMS").write_text("from a commit that failed half way\n")
    final = store.commit(make_meta("ck5"))
    assert sorted(p.name for p in final.iterdir()) == \
        [CHECKPOINT_LOCK, "XXH128SUMS", IMAGES, "meta.json"]


def test_old_sha256sums_checkpoints_still_verify(tmp_path: Path) -> None:
    old = Store(tmp_path / "store", algorithm=SHA256)
    _partial(old, "old", {"pages-1.img": b"p" * 1000})
    old.commit(make_meta("old"))
    new = Store(tmp_path / "store")  # today's default
    assert new.algorithm == XXH3
    new.verify("old")
    (tmp_path / "store" / "old" / IMAGES / "pages-1.img").write_bytes(b"x")
    with pytest.raises(StoreError, match=r"pages-1\.img checksum mismatch"):
        new.verify("old")


def test_a_recovered_partial_is_checksummed_from_disk(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    images = _partial(store, "ck6", {"pages-1.img": b"p" * 3000})
    (images / "dump.log").write_text("(00.1) Dumping finished successfully\n")
    assert store.recover_partials() == [("ck6", "completed")]
    assert not (store.root / f"{PARTIAL_PREFIX}ck6").exists()
    store.verify("ck6")


def test_the_hook_module_stays_stdlib_only() -> None:
    """It runs as `python -I -S criu_hook.py`, outside the package: the standard library only."""
    tree = ast.parse(Path(criu_hook.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
