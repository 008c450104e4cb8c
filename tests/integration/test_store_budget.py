"""A store that cannot fill the disk (issue 26, item 9), acted out on a real small file system
(ext4 on a loop mount) holding the store of a real daemon: jobs are checkpointed until the
budget is reached; restored checkpoints are pruned to make room, oldest first; one that has not
been restored is never deleted, not even the oldest; the next checkpoint is refused with an
event that names the budget, and the rule's next action (kill) runs, once; and the file system
never goes below store_keep_free meanwhile (sampled all along)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from bench.soakstore import loop_store
from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration

MiB = 1 << 20
ROOM = 108 * MiB  # what keep_free leaves the store: four ~23 MiB checkpoints, not five


def free_bytes(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


class FreeSampler:
    """The file system's free bytes, sampled every few milliseconds in a thread: the lowest."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lowest = free_bytes(path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.lowest = min(self.lowest, free_bytes(self.path))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.lowest


def cli(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "oomguard", "--socket", str(sock), "--log-format", "json",
            *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def checkpointed_job(guard: DaemonProcess, cgroups: CgroupFactory, tmp_path: Path,
                     name: str) -> str:
    """A ~28 MiB job (a ~23 MiB checkpoint) started and checkpointed on request; its id."""
    log = tmp_path / f"{name}.log"
    job = start_in_cgroup(cgroups.make(name, None), hog_argv(log, target=16, rate=500,
                                                              count=10**7))
    assert wait_until(lambda: last_count(log) > 10, 20)
    done = cli(guard.socket, "checkpoint", str(job.pid))
    assert done.returncode == 0, done.stderr
    assert job.wait(timeout=10) == -signal.SIGKILL
    return done.stdout.strip()


def test_a_busy_store_never_fills_its_disk(cgroups: CgroupFactory, tmp_path: Path) -> None:
    with loop_store(tmp_path, 256) as disk:
        store = disk / "store"
        keep_free = free_bytes(disk) - ROOM
        guarded = cgroups.make("victim", 64 * MiB)
        config = tmp_path / "budget.toml"
        config.write_text(f'[daemon]\nstore_max_size = "90%"\nstore_keep_free = {keep_free}\n'
                          f'\n[[guard]]\ncgroups = ["{guarded.path}"]\n'
                          'actions = ["checkpoint", "kill"]\nkill_grace = "1s"\n'
                          'store_margin = "1M"\n')
        sampler = FreeSampler(disk)
        restored: list[int] = []
        try:
            with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
                guard.wait_event("guard.armed")
                assert wait_until(guard.socket.exists, 10)
                oldest = checkpointed_job(guard, cgroups, tmp_path, "oldest")  # never restored
                first = checkpointed_job(guard, cgroups, tmp_path, "first")
                second = checkpointed_job(guard, cgroups, tmp_path, "second")
                for checkpoint_id in (second, first):  # restored newest first: pruned by age
                    back = cli(guard.socket, "restore", checkpoint_id)
                    assert back.returncode == 0, back.stderr
                    restored.append(int(back.stdout.strip()))
                for pid in restored:  # their processes are not what this test is about
                    kill_pid(pid)
                unrestored = [oldest, checkpointed_job(guard, cgroups, tmp_path, "third")]
                assert not guard.events("store.pruned")  # four fit
                unrestored.append(checkpointed_job(guard, cgroups, tmp_path, "fourth"))
                [pruned] = guard.wait_event("store.pruned")
                assert pruned["id"] == first, "the oldest restored checkpoint goes first"
                unrestored.append(checkpointed_job(guard, cgroups, tmp_path, "fifth"))
                pruned_ids = [e["id"] for e in guard.wait_event("store.pruned", count=2)]
                assert pruned_ids == [first, second]
                # Nothing restored is left to prune: the rule's checkpoint is refused, and its
                # next action runs, once.
                log = tmp_path / "victim.log"
                victim = start_in_cgroup(guarded, hog_argv(log, target=60, rate=200,
                                                           count=10**7))
                [refused] = guard.wait_event("checkpoint.refused", timeout=60)
                assert refused["pid"] == victim.pid, refused
                assert "budget" in refused["reason"], refused
                for figure in ("used", "cap", "free", "keep_free"):
                    assert isinstance(refused[figure], int), (figure, refused)
                assert refused["keep_free"] == keep_free
                assert refused["then"] == "kill"
                [killed] = guard.wait_event("victim.killed", timeout=30)
                assert killed["pid"] == victim.pid
                assert victim.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
                assert len(guard.events("checkpoint.refused")) == 1
                assert not guard.events("checkpoint.done") or all(
                    e["pid"] != victim.pid for e in guard.events("checkpoint.done"))
                status = cli(guard.socket, "status", "--json")
                assert status.returncode == 0, status.stderr
                figures = json.loads(status.stdout)["store"]
                assert figures["keep_free"] == keep_free and figures["over"] is False
                assert figures["used"] + figures["free"] <= figures["total"]
                text = cli(guard.socket, "status")
                assert "store: " in text.stdout and "store_keep_free" in text.stdout, text.stdout
            left = {m.id: m.state for m in Store(store).list()}
            assert left == dict.fromkeys(unrestored, "checkpointed")
        finally:
            lowest = sampler.stop()
            for pid in restored:
                kill_pid(pid)
        print(f"figures: keep_free {keep_free >> 20} MiB, lowest free {lowest >> 20} MiB, "
              f"refused at used {refused['used'] >> 20} MiB free {refused['free'] >> 20} MiB")
        assert lowest >= keep_free, f"free fell to {lowest} below keep_free {keep_free}"


def test_a_user_cannot_fill_the_store_by_asking(cgroups: CgroupFactory, tmp_path: Path) -> None:
    """A real unprivileged user asks the daemon, over its socket, to checkpoint their own job
    while the store's file system is at its keep_free: refused before the job is stopped (it
    counts on), with the budget's figures, and nothing is written to the store. (Refused
    before any dump: it runs here, where CRIU could not dump another user's process.)"""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv(1) missing")
    uid = unprivileged_user("oomguard-t-filler", 40091)
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    logs = Path(tempfile.mkdtemp(prefix="ogb-", dir="/tmp"))  # pytest's tmp is root's alone
    logs.chmod(0o777)
    log = logs / "hog.log"
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    with loop_store(tmp_path, 128) as disk:
        store = disk / "store"
        keep_free = free_bytes(disk) - 8 * MiB  # room for 8 MiB: not for a ~28 MiB job
        config = tmp_path / "full.toml"
        config.write_text(f'[daemon]\nstore_keep_free = {keep_free}\n')
        job = start_in_cgroup(cgroups.make("filler", None),
                              [*as_user, *hog_argv(log, target=16, rate=500, count=10**7)])
        try:
            with daemon(store, tmp_path / "daemon.log", "--config", str(config),
                        socket=sock) as guard:
                guard.wait_event("guard.started")
                assert wait_until(sock.exists, 10)
                assert wait_until(lambda: last_count(log) > 5, 20)
                asked = subprocess.run(
                    [*as_user, sys.executable, "-m", "oomguard", "--socket", str(sock),
                     "checkpoint", str(job.pid)], capture_output=True, text=True, cwd="/",
                    timeout=60, stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"]})
                assert asked.returncode == 1, asked.stderr
                assert "the store's budget has no room" in asked.stderr, asked.stderr
                assert "keeps" in asked.stderr and "free on its file system" in asked.stderr
                counted = last_count(log)
                assert wait_until(lambda: last_count(log) > counted + 3, 10)  # never stopped
                assert proc_state(job.pid) in ("S", "R")
                assert not guard.events("victim.frozen") and not guard.events("checkpoint.done")
            assert not [p for p in store.iterdir() if not p.name.startswith(".")]
        finally:
            kill_pid(job.pid)
            job.wait(timeout=10)
            shutil.rmtree(logs, ignore_errors=True)


def test_a_small_job_in_a_roomy_cgroup_is_checkpointed_into_a_small_store(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    """The packaged host's case: a store capped far below the job's cgroup limit (60 MiB
    against 256 MiB). The job's ~28 MiB fit: only the room it may still grow by does not, so
    its memory as it is now is reserved and measured again once it has stopped, and the
    checkpoint is taken (it was refused, the job untouched, while the estimate counted the
    whole room under the limit)."""
    with loop_store(tmp_path, 128) as disk:
        store = disk / "store"
        config = tmp_path / "small.toml"
        config.write_text('[daemon]\nstore_max_size = "60M"\n')
        with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
            guard.wait_event("guard.started")
            log = tmp_path / "roomy.log"
            job = start_in_cgroup(cgroups.make("roomy", 256 * MiB),
                                  hog_argv(log, target=16, rate=500, count=10**7))
            try:
                assert wait_until(lambda: last_count(log) > 10, 20)
                done = cli(guard.socket, "checkpoint", str(job.pid))
                assert done.returncode == 0, done.stderr
                assert job.wait(timeout=10) == -signal.SIGKILL
                checkpoint_id = done.stdout.strip()
                assert Store(store).get(checkpoint_id).state == "checkpointed"
            finally:
                kill_pid(job.pid)
                job.wait(timeout=10)
