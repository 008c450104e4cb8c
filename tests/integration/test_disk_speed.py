"""Checkpoints at the disk's speed, with the store's guarantees kept, on the real kernel with the
real CRIU: checksums taken during the dump (from the page cache, finished in CRIU's post-dump
action), the pages verified while CRIU reads them with the verdict given before the restored
tree runs, and older SHA256SUMS checkpoints still restoring."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from oomguard.store.integrity import image_files
from tests.helpers import (
    REPO,
    CgroupFactory,
    hog_argv,
    kill_pid,
    last_count,
    oomguard_argv,
    parse_events,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def _checkpointed_hog(cgroups: CgroupFactory, store: Path, tmp_path: Path, name: str,
                      target: int = 160, count: int = 400) -> tuple[str, Path, dict[str, object]]:
    cg = cgroups.make(name, None)
    log = tmp_path / f"{name}.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=target, rate=1000, count=count, tick=0.01))
    assert wait_until(lambda: last_count(log) > 30, 30)
    # What the CLI (and CRIU, its child) read from the disk itself rather than the page
    # cache: ru_inblock (512-byte blocks) of the children reaped meanwhile, the CLI alone.
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    result = run_oomguard(store, "checkpoint", str(hog.pid))
    read_blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - before
    assert result.returncode == 0, result.stderr
    hog.wait(timeout=10)
    [done] = [e for e in parse_events(result.stderr) if e.get("event") == "checkpoint.done"]
    done["read_from_disk_bytes"] = read_blocks * 512
    return str(done["id"]), log, done


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_checksums_are_taken_during_the_dump_and_the_commit_reads_nothing_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, _, done = _checkpointed_hog(cgroups, store, tmp_path, "digest")
    path = store / checkpoint_id
    # .lock: the checkpoint's lock file (an flock on it is the server's on NFS), kept with it.
    assert sorted(p.name for p in path.iterdir()) == [".lock", "XXH128SUMS", "files.json",
                                                       "images", "meta.json"]
    dump_log = (path / "images" / "dump.log").read_text(errors="replace")
    assert "digests ok in" in dump_log, "the post-dump action did not get the digests"
    Store(store).verify(checkpoint_id)  # the digests taken from memory are those on disk
    # The commit hashed only stats-dump (written after the post-dump action): nothing of the
    # images was read back from disk, where the old commit read all of them (their cache
    # dropped by the post-dump action).
    images = int(str(done["image_bytes"]))
    assert int(str(done["read_from_disk_bytes"])) < images // 10, done


def test_damaged_pages_are_found_while_criu_reads_and_the_tree_never_runs(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, log, _ = _checkpointed_hog(cgroups, store, tmp_path, "pages")
    pages = sorted((store / checkpoint_id / "images").glob("pages-*.img"))[0]
    offset = pages.stat().st_size - 4096 * 5 + 11  # near the end: CRIU has read all else
    _flip(pages, offset)
    before = log.read_bytes()
    refused = run_oomguard(store, "restore", checkpoint_id)
    assert refused.returncode == 1
    assert "damaged" in refused.stderr and f"{pages.name} checksum mismatch" in refused.stderr
    assert "killed before it ran" in refused.stderr
    restore_log = (store / checkpoint_id / "restore.log").read_text(errors="replace")
    assert "Aborting restore due to post-restore script" in restore_log  # CRIU killed it
    time.sleep(0.5)
    assert log.read_bytes() == before, "the restored tree ran"
    meta = Store(store).get(checkpoint_id)
    assert meta.state == "checkpointed"
    assert not ProcReader().exists(meta.pid) or ProcReader().state(meta.pid) == "Z"
    # Repaired: the same checkpoint restores and the hog finishes with its memory intact.
    _flip(pages, offset)
    restored = run_oomguard(store, "restore", checkpoint_id)
    assert restored.returncode == 0, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        assert wait_until(lambda: "done 400 ok" in log.read_text(), 60), log.read_text()[-300:]
        assert read_counts(log) == list(range(1, 401))
        [event] = [e for e in parse_events(restored.stderr) if e.get("event") == "restore.done"]
        assert event["total_s"] >= event["seconds"] > 0 and event["verify_s"] > 0
    finally:
        kill_pid(pid)


def test_a_damaged_description_is_refused_before_criu_reads_it(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, _, _ = _checkpointed_hog(cgroups, store, tmp_path, "core", target=32)
    images = store / checkpoint_id / "images"
    core = sorted(images.glob("core-*.img"))[0]
    _flip(core, 20)
    refused = run_oomguard(store, "restore", checkpoint_id)
    assert refused.returncode == 1
    assert f"{core.name} checksum mismatch" in refused.stderr
    assert not (store / checkpoint_id / "restore.log").exists(), "CRIU was run"
    assert not list((store / checkpoint_id).glob(".verify.*")), "the gate was left behind"


def test_a_checkpoint_with_sha256sums_from_before_still_restores(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, log, _ = _checkpointed_hog(cgroups, store, tmp_path, "old", target=64,
                                              count=300)
    path = store / checkpoint_id
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in image_files(path / "images")}
    (path / "SHA256SUMS").write_text("".join(f"{d}  {n}\n" for n, d in sorted(sums.items())))
    os.chmod(path / "SHA256SUMS", 0o600)
    (path / "XXH128SUMS").unlink()
    shown = run_oomguard(store, "show", checkpoint_id, "--json")
    assert json.loads(shown.stdout)["id"] == checkpoint_id
    restored = run_oomguard(store, "restore", checkpoint_id)
    assert restored.returncode == 0, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        assert wait_until(lambda: "done 300 ok" in log.read_text(), 60), log.read_text()[-300:]
    finally:
        kill_pid(pid)


def test_compressed_pages_are_written_during_the_dump_and_expanded_for_the_restore(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`[criu] compress = "zstd"`: the hog's pages (a byte repeated per 4 MiB chunk) are
    stored as pages-N.img.zst, a small fraction of the plain size; the restore expands them,
    verified, and the job goes on with its memory intact; --lazy restores it eagerly, saying
    why; the expanded file does not stay."""
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\n\n[criu]\ncompress = "zstd"\n')
    monkeypatch.setenv("OOMGUARD_CONFIG", str(config))
    checkpoint_id, log, done = _checkpointed_hog(cgroups, store, tmp_path, "zstd")
    images = store / checkpoint_id / "images"
    assert sorted(p.name for p in images.glob("pages-*")) == \
        [f"{p.name}" for p in sorted(images.glob("pages-*.img.zst"))] != []
    meta = Store(store).get(checkpoint_id)
    raw = sum(meta.extra["compressed"].values())
    assert raw > 150 << 20 and meta.image_bytes < raw // 10, (raw, meta.image_bytes)
    # compressed from memory beside the dump, not read back from disk
    assert int(str(done["read_from_disk_bytes"])) < raw // 10, done
    Store(store).verify(checkpoint_id)  # the stored .zst, as xxh128sum -c would
    restored = run_oomguard(store, "restore", "--lazy", checkpoint_id)
    assert restored.returncode == 0, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        assert "restored eagerly, not lazily: its pages are compressed" in restored.stderr
        assert wait_until(lambda: "done 400 ok" in log.read_text(), 60), log.read_text()[-300:]
        assert read_counts(log) == list(range(1, 401))
        assert not list(images.glob("pages-*.img")), "the expanded pages were left"
    finally:
        kill_pid(pid)


def test_a_damaged_compressed_checkpoint_is_refused_before_criu(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\n\n[criu]\ncompress = "zstd"\n')
    monkeypatch.setenv("OOMGUARD_CONFIG", str(config))
    checkpoint_id, _, _ = _checkpointed_hog(cgroups, store, tmp_path, "zbad", target=64)
    [stored] = sorted((store / checkpoint_id / "images").glob("pages-*.img.zst"))
    _flip(stored, stored.stat().st_size // 2)
    refused = run_oomguard(store, "restore", checkpoint_id)
    assert refused.returncode == 1
    assert f"{stored.name}" in refused.stderr and "damaged" in refused.stderr, refused.stderr
    assert not (store / checkpoint_id / "restore.log").exists(), "CRIU was run"
    assert not list((store / checkpoint_id / "images").glob("pages-*.img"))


# A daemon guarding a thousand v1 cgroups holds more than FD_SETSIZE (1024) descriptors, so the
# gates' FIFOs get numbers select() refuses: the digester died, the post-dump action waited out
# its timeout (a 167 MiB dump took 5.3 s) and the commit read every image back.
CROWD = 1100
CROWDED = (
    "import os, resource, sys\n"
    f"soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    f"resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, {CROWD} + 200), max(hard, {CROWD} + 200)))\n"
    "for _ in range({crowd}):\n"
    "    os.set_inheritable(os.open('/dev/null', os.O_RDONLY), True)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
).replace("{crowd}", str(CROWD))


def _crowded(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI (checkpoint, restore) run as if it were that daemon: over 1100 descriptors
    open, so every one it opens itself is numbered above 1100."""
    argv = oomguard_argv(store, *args)
    return subprocess.run([sys.executable, "-c", CROWDED, *argv[1:]], capture_output=True,
                          text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)


def test_a_process_holding_more_than_1024_descriptors_still_gets_digests_and_verdict(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("crowded", None)
    log = tmp_path / "crowded.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=160, rate=1000, count=400, tick=0.01))
    assert wait_until(lambda: last_count(log) > 30, 30)
    result = _crowded(store, "checkpoint", str(hog.pid))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    hog.wait(timeout=10)
    [done] = [e for e in parse_events(result.stderr) if e.get("event") == "checkpoint.done"]
    checkpoint_id = str(done["id"])
    dump_log = (store / checkpoint_id / "images" / "dump.log").read_text(errors="replace")
    assert "digests ok in" in dump_log, "the post-dump action did not get the digests"
    restored = _crowded(store, "restore", checkpoint_id)
    assert restored.returncode == 0, restored.stderr
    assert "Traceback" not in restored.stderr, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        restore_log = (store / checkpoint_id / "restore.log").read_text(errors="replace")
        assert "images not verified" not in restore_log
        assert wait_until(lambda: "done 400 ok" in log.read_text(), 60), log.read_text()[-300:]
        assert read_counts(log) == list(range(1, 401))
    finally:
        kill_pid(pid)
