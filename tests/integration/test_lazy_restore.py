"""`oomguard restore --lazy` on the real kernel with the real CRIU: the job runs again at once and
its memory streams in behind it (userfaultfd), intact; the keeper holds the restore lock until
every page is in, kills a job whose pages turn out damaged, and the restore is eager (saying
why) where userfaultfd is unavailable. Through the daemon, the exit watch still sees the job
end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.criu import find_criu
from oomguard.lifecycle.restore import WARM_BUDGET, warm_small_runs
from oomguard.model.errors import StoreError
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from oomguard.store.criu_hook import drop_cache
from oomguard.store.pagemap import small_runs
from tests.helpers import (
    REPO,
    CgroupFactory,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    parse_events,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def _checkpoint(cgroups: CgroupFactory, store: Path, tmp_path: Path, name: str, *,
                target: int = 256, count: int = 300) -> tuple[str, Path]:
    cg = cgroups.make(name, None)
    log = tmp_path / f"{name}.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=target, rate=1000, count=count, tick=0.01))
    # Every MiB in before the checkpoint (the hog's count also advances while it grows: on a
    # loaded machine 30 lines were only 120 MiB), then 30 more beats.
    grown_at = wait_until(lambda: _held(log) >= target and last_count(log), 30)
    assert grown_at, log.read_text()[-300:] if log.exists() else "no hog log"
    assert wait_until(lambda: last_count(log) > grown_at + 30, 30)
    done = run_oomguard(store, "checkpoint", str(hog.pid))
    assert done.returncode == 0, done.stderr
    hog.wait(timeout=10)
    return done.stdout.strip(), log


def _held(log: Path) -> int:
    """MiB the hog holds, from its last full line ("COUNT MiB")."""
    lines = log.read_text().splitlines()[:-1] if log.exists() else []  # the last may be partial
    fields = lines[-1].split() if lines else []
    return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else 0


def _event(stderr: str, name: str) -> dict[str, Any]:
    return next(e for e in parse_events(stderr) if e.get("event") == name)


def _status(store: Path, checkpoint_id: str) -> dict[str, Any] | None:
    path = store / checkpoint_id / "lazy.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_the_job_runs_at_once_and_its_memory_follows_intact(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, log = _checkpoint(cgroups, store, tmp_path, "lazy", target=400, count=500)
    mark = last_count(log)
    restored = run_oomguard(store, "restore", "--lazy", checkpoint_id)
    assert restored.returncode == 0, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        done = _event(restored.stderr, "restore.done")
        assert done["lazy"] is True, done  # how soon it runs: bench part 'lazy'
        assert 0 < done["warmed_bytes"] <= WARM_BUDGET, done  # the interpreter, not the buffer
        # While pages stream in, the restore lock is the keeper's: no forget, no restore.
        try:
            Store(store).forget(checkpoint_id)
        except StoreError as exc:
            assert "being restored right now" in str(exc)
        else:
            raise AssertionError("forgotten while its pages streamed in")
        assert wait_until(lambda: "done 500 ok" in log.read_text(), 60), log.read_text()[-300:]
        assert read_counts(log) == list(range(1, 501)) and mark > 130
        status = wait_until(lambda: _status(store, checkpoint_id), 30)
        assert status and status["outcome"] == "resident", status
        assert status["pages_bytes"] > 390 << 20
        assert status["running_at"] <= status["resident_at"] <= status["verified_at"]
        # The keeper and the lazy-pages daemon have ended, and given the lock back.
        for helper in (status["lazy_pages_pid"],):
            assert wait_until(lambda h=helper: not ProcReader().exists(h) or
                              ProcReader().state(h) == "Z", 10)
        meta = Store(store).get(checkpoint_id)
        assert meta.state == "restored" and meta.restored_pid == pid
        with Store(store).restore_lock(checkpoint_id):
            pass
    finally:
        kill_pid(pid)


def test_the_jobs_small_runs_of_memory_are_warmed_and_its_bulk_is_not(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """On a real checkpoint of a 256 MiB hog: the pagemaps account for every byte of the pages
    images; what a lazy restore warms first is the interpreter's small runs, not the hog's
    buffer, and they are in the page cache soon after."""
    checkpoint_id, _ = _checkpoint(cgroups, store, tmp_path, "lazywarm")
    images = store / checkpoint_id / "images"
    pages = {p.name: p.stat().st_size for p in images.glob("pages-*.img")}
    every = small_runs(images, 1 << 40)
    assert sum(r.length for r in every) == sum(pages.values())
    for name, size in pages.items():  # each file's runs tile it, in order
        spans = sorted((r.offset, r.length) for r in every if r.pages_file == name)
        assert [o for o, _ in spans] == [0, *[o + n for o, n in spans][:-1]]
        assert spans[-1][0] + spans[-1][1] == size
    buffer = max(every, key=lambda r: r.length)
    assert buffer.length >= 256 << 20
    warmed = small_runs(images, WARM_BUDGET)
    assert warmed and buffer not in warmed and sum(r.length for r in warmed) <= WARM_BUDGET
    drop_cache([str(images / name) for name in pages])
    assert warm_small_runs(images) == sum(r.length for r in warmed)

    def cached() -> bool:
        for run in warmed:
            fd = os.open(images / run.pages_file, os.O_RDONLY)
            try:
                os.preadv(fd, [bytearray(run.length)], run.offset, os.RWF_NOWAIT)
            except BlockingIOError:
                return False
            finally:
                os.close(fd)
        return True
    assert wait_until(cached, 10)
    drop_cache([str(images / name) for name in pages])


def test_damaged_pages_found_while_streaming_kill_the_job_and_keep_the_checkpoint(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, log = _checkpoint(cgroups, store, tmp_path, "lazybad")
    pages = sorted((store / checkpoint_id / "images").glob("pages-*.img"))[0]
    with pages.open("r+b") as handle:
        handle.seek(4096 * 10 + 5)
        byte = handle.read(1)
        handle.seek(4096 * 10 + 5)
        handle.write(bytes([byte[0] ^ 0xFF]))
    restored = run_oomguard(store, "restore", "--lazy", checkpoint_id)
    assert restored.returncode == 0, restored.stderr  # the job runs before its pages are in
    pid = int(restored.stdout.strip())
    try:
        status = wait_until(lambda: _status(store, checkpoint_id), 60)
        assert status and status["outcome"] == "damaged", status
        assert status["problems"] == [f"{pages.name} checksum mismatch"]
        assert wait_until(lambda: not ProcReader().exists(pid) or
                          ProcReader().state(pid) == "Z", 10), "the job was not killed"
        meta = Store(store).get(checkpoint_id)
        assert meta.state == "checkpointed"
        assert "checksum mismatch" in meta.extra["lazy_restore_failed"]
        assert "done" not in log.read_text()
        eager = run_oomguard(store, "restore", checkpoint_id)
        assert eager.returncode == 1 and f"{pages.name} checksum mismatch" in eager.stderr
    finally:
        kill_pid(pid)


NO_UFFD_CRIU = """#!/bin/sh
if [ "$1" = check ] && [ "$2" = --feature ] && [ "$3" = uffd-noncoop ]; then
    echo "UFFD is not supported (simulated)" >&2
    exit 1
fi
exec "{criu}" "$@"
"""


def test_without_userfaultfd_the_restore_is_eager_and_says_why(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint_id, log = _checkpoint(cgroups, store, tmp_path, "nouffd", target=64)
    fake = tmp_path / "criu-no-uffd"
    fake.write_text(NO_UFFD_CRIU.format(criu=find_criu()[0]))
    fake.chmod(0o700)
    monkeypatch.setenv("OOMGUARD_CRIU", str(fake))
    restored = run_oomguard(store, "restore", "--lazy", checkpoint_id)
    assert restored.returncode == 0, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        assert "restored eagerly, not lazily: userfaultfd is not available here" in \
            restored.stderr and "simulated" in restored.stderr, restored.stderr
        assert _event(restored.stderr, "restore.done")["lazy"] is False
        assert not (store / checkpoint_id / "lazy-pages.pid").exists()
        assert wait_until(lambda: "done 300 ok" in log.read_text(), 60), log.read_text()[-300:]
    finally:
        kill_pid(pid)


def test_through_the_daemon_the_exit_watch_sees_a_lazily_restored_job_end(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    checkpoint_id, log = _checkpoint(cgroups, store, tmp_path, "lazyd", count=300)
    with daemon(store, tmp_path / "daemon.log") as guard:
        guard.wait_event("guard.started")
        assert wait_until(guard.socket.exists, 10)
        start = time.monotonic()
        restored = subprocess.run(
            [sys.executable, "-m", "oomguard", "--socket", str(guard.socket), "--log-format",
             "json", "restore", "--lazy", checkpoint_id], capture_output=True, text=True,
            timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
        took = time.monotonic() - start
        assert restored.returncode == 0, restored.stderr
        pid = int(restored.stdout.strip())
        try:
            done = guard.wait_event("restore.done")[0]
            assert done["lazy"] is True and done["id"] == checkpoint_id
            assert took < 10
            exited = guard.wait_event("restore.exited", timeout=60)[0]
            assert exited["pid"] == pid and exited["exit_status"] == 0
            assert "done 300 ok" in log.read_text()
        finally:
            kill_pid(pid)
    assert os.path.exists(store / checkpoint_id / "lazy.json")
