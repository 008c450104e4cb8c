"""A checkpoint store on NFS (issue 28, item 3), for real: the kernel's NFS server and client,
CRIU writing its images over NFS, real daemons, real cgroups. Runs where $OOMGUARD_NFS_STORE
names an NFS mount (tests/vmlane_nfs.sh makes one inside the v2 lane: this host's kernel has
no NFS); skipped elsewhere.

What holds there, each checked below:
- the store's file system is seen as shared, so each node's records (ledgers, lock, CRIU's
  action script) go to /run/oomguard/state/..., never into the shared store;
- a checkpoint made over NFS is committed (atomic rename, fsync'd images and directory), listed,
  verifies, restores, and its process runs on from where it was;
- two nodes, each a daemon with a /run of its own (a mount namespace: its own locks and
  records), write into one store at once, and both checkpoints commit and restore; a second
  daemon on one node is refused;
- a dump in progress on another node (the flock on its partial's lock file, a lock of the
  server's) is left alone, once its holder is gone, the half checkpoint is removed, never listed
  as restorable; an flock on the directory itself would not be seen (it is the client's);
- a restore lock held on another node refuses a restore and a forget here;
- a daemon SIGKILLed in the middle of its dump leaves nothing listed that does not verify,
  and its next start loses nothing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.store.checkpoints import Store
from oomguard.store.names import (
    CHECKPOINT_LOCK,
    FROZEN_LEDGER,
    HOOKS_DIR,
    PARTIAL_PREFIX,
    STORE_LOCK,
)
from oomguard.store.nodestate import NODE_STATE_ROOT, node_state
from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    read_counts,
    start_in_cgroup,
    wait_until,
)

NFS = os.environ.get("OOMGUARD_NFS_STORE", "")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not NFS, reason="no NFS mount (tests/vmlane_nfs.sh makes one "
                                 "inside the v2 lane)")]


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    """A store directory on the NFS mount, removed after the test."""
    path = Path(NFS) / f"store-{tmp_path.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def cli(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oomguard", "--socket", str(socket),
                           "--log-format", "json", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, stdin=subprocess.DEVNULL)


def other_node() -> tuple[str, ...]:
    """A wrapper that runs a command as on another node: a mount namespace with a
    /run/oomguard of its own (its locks and records) and the export mounted again at the same
    path with `nosharecache`, a superblock of its own: its own inodes, page cache and local
    lock table, so that what it sees of the store, and of the locks in it, comes from the
    server, as another machine's would."""
    return ("unshare", "-m", "--propagation", "private", "sh", "-c",
            'mkdir -p /run/oomguard && mount -t tmpfs -o mode=0755 og-node /run/oomguard '
            f'&& mount -t nfs4 -o vers=4.2,hard,nosharecache 127.0.0.1:/ {NFS} '
            '&& exec "$@"', "other-node")


def job_cgroup(cgroups: CgroupFactory, name: str) -> MemoryCgroup:
    """The 128 MiB cgroup of a job that will outgrow it (the daemon acts at 85%)."""
    return cgroups.make(name, 128 * MiB)


def grown_job(cg: MemoryCgroup, tmp_path: Path, name: str, guard: DaemonProcess,
              on_its_node: bool = False) -> tuple[Path, subprocess.Popen[bytes]]:
    """Starts the job once `guard` guards its cgroup: under emulation a daemon takes seconds
    to start, and a job started first reached its limit (the kernel's OOM killer) before
    anything guarded it. `on_its_node`: in the guard's mount namespace (another node's, from
    other_node()), as a job on that node runs where its daemon and CRIU do."""
    guard.wait_event("guard.ready", timeout=120)
    log = tmp_path / f"{name}.log"
    argv = hog_argv(log, target=160, rate=60, count=600)
    if on_its_node:  # its stdio and working directory opened there too (CRIU looks them up)
        argv = ["nsenter", f"--mount=/proc/{guard.handle.pid}/ns/mnt", "--", "/bin/sh", "-c",
                'cd "$1" && err=$2 && shift 2 && exec "$@" < /dev/null >> "$err" 2>&1', "sh",
                str(tmp_path), str(tmp_path / f"{name}.err"), *argv]
    return log, start_in_cgroup(cg, argv, cwd=tmp_path, log=tmp_path / f"{name}.err")


def restore_and_finish(socket: Path, checkpoint_id: str, cgroups: CgroupFactory,
                       log: Path, name: str) -> None:
    before = last_count(log)
    big = cgroups.make(name, 512 * MiB)
    back = cli(socket, "restore", checkpoint_id, "--cgroup", str(big.path))
    assert back.returncode == 0, back.stderr
    pid = int(back.stdout.strip())
    try:
        assert wait_until(lambda: "done 600 ok" in log.read_text(), 180), log.read_text()[-300:]
        counts = read_counts(log)
        assert counts == list(range(1, counts[-1] + 1)) and before > 0  # went on from there
    finally:
        kill_pid(pid)


def test_the_store_on_nfs_is_seen_as_shared(shared: Path) -> None:
    state = node_state(shared)
    assert state.fs_type.startswith("nfs") and state.shared, state
    assert state.path.parent == NODE_STATE_ROOT


def test_a_checkpoint_over_nfs_commits_restores_and_keeps_the_nodes_records_local(
        shared: Path, cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg = job_cgroup(cgroups, "nfsone")
    guard = DaemonProcess(shared, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    job = None
    try:
        log, job = grown_job(cg, tmp_path, "nfsone", guard)
        [started] = guard.wait_event("guard.started")
        state = Path(started["node_state"])
        assert state.parent == NODE_STATE_ROOT, started
        assert (state / STORE_LOCK).exists() and not (shared / STORE_LOCK).exists()
        [done] = guard.wait_event("checkpoint.done", timeout=120)
        assert job.wait(timeout=60) == -signal.SIGKILL
        assert (state / HOOKS_DIR).is_dir() and (state / FROZEN_LEDGER).exists()
        # Nothing of this node's in the shared store: checkpoint directories only.
        assert sorted(p.name for p in shared.iterdir()) == [done["id"]]
        Store(shared).verify(done["id"])  # as another node would read it, over NFS
        assert [m.id for m in Store(shared).list()] == [done["id"]]
        restore_and_finish(guard.socket, done["id"], cgroups, log, "nfsonebig")
    finally:
        guard.stop()
        if job is not None:
            kill_pid(job.pid)


def test_two_nodes_write_into_one_store_at_once_and_one_node_runs_one_daemon(
        shared: Path, cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg_a, cg_b = job_cgroup(cgroups, "nodea"), job_cgroup(cgroups, "nodeb")
    node_a = DaemonProcess(shared, tmp_path / "a.log", "--cgroup", str(cg_a.path))
    # Node B's daemon is in a mount namespace whose store is another mount: it runs its CRIU
    # there, not in PID 1's (oomguard.act.hostns), or it would sum images CRIU wrote through
    # node A's mount, through its own stale caches. Its job runs there too.
    node_b = DaemonProcess(shared, tmp_path / "b.log", "--cgroup", str(cg_b.path),
                           wrapper=other_node())
    second = job_a = job_b = None
    try:
        node_a.wait_event("guard.started")
        node_b.wait_event("guard.started")  # not refused: another node's lock is not ours
        # On node A a second daemon for this store is refused (another cgroup: the store's
        # lock, not the cgroup's, refuses it), within seconds, naming the first.
        other = cgroups.make("nodea2", 128 * MiB)
        second = DaemonProcess(shared, tmp_path / "a2.log", "--cgroup", str(other.path))
        assert second.handle.wait(timeout=60) != 0
        assert f"pid {node_a.handle.pid}" in (tmp_path / "a2.log").read_text() \
            or "on this node" in (tmp_path / "a2.log").read_text(), \
            (tmp_path / "a2.log").read_text()[-2000:]
        log_a, job_a = grown_job(cg_a, tmp_path, "nodea", node_a)
        log_b, job_b = grown_job(cg_b, tmp_path, "nodeb", node_b, on_its_node=True)
        [done_a] = node_a.wait_event("checkpoint.done", timeout=180)
        [done_b] = node_b.wait_event("checkpoint.done", timeout=180)
        assert job_a.wait(timeout=60) == -signal.SIGKILL
        assert job_b.wait(timeout=60) == -signal.SIGKILL
        assert sorted(m.id for m in Store(shared).list()) == sorted([done_a["id"], done_b["id"]])
        for done in (done_a, done_b):
            Store(shared).verify(done["id"])
        assert not [p for p in shared.iterdir() if p.name.startswith(".")]
        restore_and_finish(node_b.socket, done_a["id"], cgroups, log_a, "nodeabig")
        restore_and_finish(node_a.socket, done_b["id"], cgroups, log_b, "nodebbig")
    finally:
        for guard in (node_a, node_b, second):
            if guard is not None:
                guard.stop()
        for job in (job_a, job_b):
            if job is not None:
                kill_pid(job.pid)


def test_a_dump_under_way_on_another_node_is_left_alone_and_a_dead_ones_half_is_removed(
        shared: Path) -> None:
    store = Store(shared)
    store.ensure()
    partial = shared / f"{PARTIAL_PREFIX}20261205-120000-4242-beef"
    (partial / "images").mkdir(parents=True)
    (partial / "images" / "pages-1.img").write_bytes(b"x" * 65536)
    # Another node's dump: the lock on its lock file, taken through that node's superblock.
    holder = subprocess.Popen(
        [*other_node(), sys.executable, "-I", "-c", "import fcntl, os, sys; "
         f"fd = os.open({str(partial / CHECKPOINT_LOCK)!r}, os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); "
         f"dfd = os.open({str(partial)!r}, os.O_RDONLY | os.O_DIRECTORY); "
         "fcntl.flock(dfd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert store.recover_partials() == [("20261205-120000-4242-beef", "in progress")]
        assert partial.is_dir() and store.list() == []
        # Why a file: the other node's flock on the directory is not seen here at all.
        dfd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted: the client's lock only
        finally:
            os.close(dfd)
    finally:
        holder.kill()
        holder.wait()
    assert store.recover_partials() == [("20261205-120000-4242-beef", "removed")]
    assert not partial.exists() and store.list() == []


def test_a_restore_on_one_node_refuses_a_second_on_another(
        shared: Path, cgroups: CgroupFactory, tmp_path: Path) -> None:
    """The restore lock over NFS: node B holds a checkpoint's restore lock (a restore under way
    there, or a lazy restore's keeper); node A's daemon refuses to restore it or delete it."""
    cg = job_cgroup(cgroups, "nfsrl")
    guard = DaemonProcess(shared, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    holder = job = None
    try:
        log, job = grown_job(cg, tmp_path, "nfsrl", guard)
        [done] = guard.wait_event("checkpoint.done", timeout=180)
        assert job.wait(timeout=60) == -signal.SIGKILL
        lock = shared / done["id"] / CHECKPOINT_LOCK
        holder = subprocess.Popen(
            [*other_node(), sys.executable, "-I", "-c", "import fcntl, os, sys; "
             f"fd = os.open({str(lock)!r}, os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
             "print('held', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        big = cgroups.make("nfsrlbig", 512 * MiB)
        refused = cli(guard.socket, "restore", done["id"], "--cgroup", str(big.path))
        assert refused.returncode != 0 and "being restored" in refused.stderr, refused
        gone = cli(guard.socket, "forget", done["id"])
        assert gone.returncode != 0, gone
        assert [m.id for m in Store(shared).list()] == [done["id"]]
        holder.kill()
        holder.wait()
        holder = None
        restore_and_finish(guard.socket, done["id"], cgroups, log, "nfsrlbig2")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        guard.stop()
        if job is not None:
            kill_pid(job.pid)


def test_a_daemon_killed_mid_dump_leaves_nothing_listed_that_does_not_verify(
        shared: Path, cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg = job_cgroup(cgroups, "nfskill")
    seen_bad: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # another node listing the store all along: each one it lists
        checked: set[str] = set()
        while not stop.is_set():
            for meta in Store(shared).list():
                if meta.id in checked:
                    continue
                checked.add(meta.id)
                try:
                    Store(shared).verify(meta.id)
                except Exception as exc:
                    seen_bad.append(f"{meta.id}: {exc}")
            stop.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    guard = DaemonProcess(shared, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    again = job = None
    try:
        log, job = grown_job(cg, tmp_path, "nfskill", guard)
        assert wait_until(lambda: shared.is_dir() and any(
            p.name.startswith(PARTIAL_PREFIX) for p in shared.iterdir()), 180), \
            guard.log.read_text()[-3000:]
        guard.handle.send_signal(signal.SIGKILL)  # in the middle of the dump
        guard.handle.wait(timeout=30)
        again = DaemonProcess(shared, tmp_path / "again.log", "--cgroup", str(cg.path))
        again.wait_event("guard.started", timeout=60)
        # Nothing lost: the new daemon thaws the job or finishes its dump; still growing
        # past its limit, it is checkpointed (by the first daemon's dump or the next one's).
        assert wait_until(lambda: Store(shared).list(), 240), again.log.read_text()[-3000:]
        [meta] = Store(shared).list()
        Store(shared).verify(meta.id)
        assert job.wait(timeout=60) == -signal.SIGKILL
        restore_and_finish(again.socket, meta.id, cgroups, log, "nfskillbig")
    finally:
        stop.set()
        watcher.join(timeout=10)
        for guard_ in (guard, again):
            if guard_ is not None:
                guard_.stop()
        if job is not None:
            kill_pid(job.pid)
    assert seen_bad == [], seen_bad
