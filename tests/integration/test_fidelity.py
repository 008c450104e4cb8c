"""What a restore must give back besides memory: a task the user had stopped stays stopped
(through a checkpoint, a failed dump and a restore, with no continue seen by its parent), a
TCP server under connection load checkpoints and answers again, and a log file others appended
to meanwhile is appended to after their lines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    kill_pid,
    last_count,
    oomguard_argv,
    proc_state,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

FAMILY = REPO / "tests" / "workloads" / "family.py"


def family_argv(log: Path, *, hold: int = 0, go: Path | None = None) -> list[str]:
    argv = [sys.executable, str(FAMILY), "--log", str(log), "--hold", str(hold)]
    return argv + (["--go", str(go)] if go is not None else [])


class Family:
    """The files of one family.py run: children's counts and pids, the parent's events."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.kids = [Path(f"{log}.child{i}") for i in range(2)]
        self.events_file = Path(f"{log}.events")

    def kid_pid(self, index: int) -> int:
        """The child's pid as it sees it (its PID namespace's)."""
        return int(Path(f"{self.kids[index]}.pid").read_text())

    def started(self) -> bool:
        return (all(Path(f"{k}.pid").exists() and last_count(k) > 5 for k in self.kids)
                and self.events_file.exists())

    def events(self) -> list[str]:
        return self.events_file.read_text().splitlines() if self.events_file.exists() else []


def host_pid(root: int, ns_pid: int) -> int | None:
    """The host pid of the task of `root`'s tree whose innermost pid is `ns_pid`."""
    proc = ProcReader()
    for info in proc.processes(proc.descendants(root)):
        if info.nspid[-1] == ns_pid:
            return info.pid
    return None


def counts_without_gap(path: Path) -> bool:
    counts = read_counts(path)
    return counts == list(range(1, len(counts) + 1))


def stop_child(family: Family, pid: int, ns_pid: int) -> int:
    """SIGSTOP a child as the user would; returns its count once its parent has seen it stop."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: proc_state(pid) == "T"
                      and f"stopped {ns_pid}" in family.events(), 10), family.events()
    return last_count(family.kids[0])


def assert_stays_stopped(family: Family, pid: int, ns_pid: int, mark: int) -> None:
    """Still stopped, not counting while its sibling counts on, never continued in the eyes of
    its parent; then continued by hand it goes on from where it was."""
    running = last_count(family.kids[1])
    assert wait_until(lambda: last_count(family.kids[1]) > running + 25, 20), "sibling stuck"
    assert proc_state(pid) == "T"
    assert last_count(family.kids[0]) == mark
    assert f"continued {ns_pid}" not in family.events(), family.events()
    os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: last_count(family.kids[0]) > mark + 5, 10), "did not go on"
    assert counts_without_gap(family.kids[0])
    # The parent's waitpid works: it does report the real continue.
    assert wait_until(lambda: f"continued {ns_pid}" in family.events(), 10), family.events()


def test_a_task_the_user_stopped_is_restored_stopped(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("userstop", None)
    family = Family(tmp_path / "family.log")
    parent = start_in_cgroup(cg, family_argv(family.log))
    pids: list[int] = [parent.pid]
    try:
        assert wait_until(family.started, 20)
        stopped = family.kid_pid(0)
        mark = stop_child(family, stopped, stopped)

        done = run_oomguard(store, "checkpoint", str(parent.pid))
        assert done.returncode == 0, done.stderr
        assert parent.wait(timeout=10) == -signal.SIGKILL
        meta = Store(store).get(done.stdout.strip())
        pids = meta.pids
        assert meta.stopped_nspids == [stopped]
        assert last_count(family.kids[0]) == mark

        back = run_oomguard(store, "restore", meta.id)
        assert back.returncode == 0, back.stderr
        assert int(back.stdout.strip()) == parent.pid
        assert proc_state(stopped) == "T"
        assert_stays_stopped(family, stopped, stopped, mark)
        assert counts_without_gap(family.kids[1])  # the other child went on without a gap
    finally:
        for pid in pids:
            kill_pid(pid)


def test_a_shell_job_with_a_stopped_task_survives_its_restore(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A job started by a shell with job control leads its process group but not its session:
    restored into CRIU's session, its group is orphaned when CRIU exits, and the kernel sends
    an orphaned group with a stopped task SIGHUP, then SIGCONT. Keeping the task stopped would
    kill the whole job: it is continued instead (what the kernel would do), and the job lives."""
    cg = cgroups.make("userstopjob", None)
    family = Family(tmp_path / "family.log")
    pidfile = tmp_path / "job.pid"
    script = 'set -m; "$@" & echo $! > "$0"; while :; do sleep 0.2; done'
    shell = start_in_cgroup(cg, ["/bin/bash", "-c", script, str(pidfile),
                                 *family_argv(family.log)])
    pids: list[int] = []
    try:
        assert wait_until(lambda: pidfile.exists() and family.started(), 20)
        job = int(pidfile.read_text())
        assert os.getpgid(job) == job and os.getsid(job) != job
        pids = [job]
        stopped = family.kid_pid(0)
        mark = stop_child(family, stopped, stopped)
        done = run_oomguard(store, "checkpoint", str(job))
        assert done.returncode == 0, done.stderr
        meta = Store(store).get(done.stdout.strip())
        pids = meta.pids
        assert meta.stopped_nspids == [stopped]
        target = cgroups.make("userstopjobback", None)
        back = run_oomguard(store, "restore", meta.id, "--cgroup", str(target.path))
        assert back.returncode == 0, back.stderr
        running = last_count(family.kids[1])
        assert wait_until(lambda: last_count(family.kids[1]) > running + 10
                          and last_count(family.kids[0]) > mark + 10, 20), "the job died"
        assert all(proc_state(pid) not in (None, "Z", "T") for pid in meta.pids)
        assert counts_without_gap(family.kids[0]) and counts_without_gap(family.kids[1])
    finally:
        for pid in (*pids, shell.pid):
            kill_pid(pid)
        shell.wait(timeout=10)


def _with_outside_peer(cgroup: object, argv: list[str]) -> tuple[subprocess.Popen[bytes],
                                                                 socket.socket]:
    """Started holding a UNIX stream socket whose peer is this test: CRIU cannot dump that,
    so the checkpoint fails for real."""
    ours, theirs = socket.socketpair()
    cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.path / "cgroup.procs"),  # type: ignore[attr-defined]
           *argv]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                            start_new_session=True)
    theirs.close()
    return proc, ours


def test_a_failed_dump_leaves_the_user_stopped_task_stopped(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("userstopfail", None)
    family = Family(tmp_path / "family.log")
    parent, peer = _with_outside_peer(cg, family_argv(family.log))
    kids: list[int] = []
    try:
        assert wait_until(family.started, 20)
        kids = [family.kid_pid(0), family.kid_pid(1)]
        mark = stop_child(family, kids[0], kids[0])
        failed = run_oomguard(store, "checkpoint", str(parent.pid))
        assert failed.returncode == 1
        assert '"outcome": "thawed"' in failed.stderr, failed.stderr
        assert proc_state(parent.pid) not in ("T", "t") and proc_state(kids[1]) not in ("T", "t")
        assert_stays_stopped(family, kids[0], kids[0], mark)
        assert not Store(store).list()
    finally:
        peer.close()
        for pid in [parent.pid, *kids]:
            kill_pid(pid)
        parent.wait()


def test_exec_job_at_the_threshold_keeps_its_stopped_task_stopped(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Through the daemon at the threshold, in the job's own PID namespace (`oomguard exec`):
    restored with new host pids, the task is found by its namespace pid."""
    small = cgroups.make("userstopexec", 160 * MiB)
    big = cgroups.make("userstopexecbig", 768 * MiB)
    family = Family(tmp_path / "family.log")
    go = tmp_path / "go"
    restored = 0
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        wrapper = start_in_cgroup(None, [*oomguard_argv(store), "exec", "--cgroup",
                                         str(small.path), "--",
                                         *family_argv(family.log, hold=200, go=go)],
                                  cwd=tmp_path)
        try:
            assert wait_until(family.started, 20)
            root = next(p for p in ProcReader().processes(small.procs()) if p.is_pidns_init)
            ns_stopped = family.kid_pid(0)
            mark = stop_child(family, host_pid(root.pid, ns_stopped) or 0, ns_stopped)
            go.touch()  # the parent grows past the threshold
            # The v2 lane's emulated VM dumps at a few MB/s: give it time.
            done = guard.wait_event("checkpoint.done", timeout=240)[0]
            wrapper.wait(timeout=10)
        finally:
            kill_pid(wrapper.pid)
    meta = Store(store).get(done["id"])
    assert meta.pidns and meta.stopped_nspids == [ns_stopped]
    assert small.snapshot().oom_kills == 0
    back = run_oomguard(store, "restore", meta.id, "--cgroup", str(big.path))
    assert back.returncode == 0, back.stderr
    restored = int(back.stdout.strip())
    try:
        stopped = host_pid(restored, ns_stopped)
        assert stopped is not None
        assert_stays_stopped(family, stopped, ns_stopped, mark)
        assert counts_without_gap(family.kids[1])
    finally:
        kill_pid(restored)


SERVER = REPO / "tests" / "workloads" / "server.py"


class Clients(threading.Thread):
    """A client connecting every few ms, keeping each answer (the server's count)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.answers: list[int] = []
        self.failures = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.3) as conn:
                    data = conn.recv(64)
                if data:
                    self.answers.append(int(data.split()[0]))
                else:
                    self.failures += 1
            except OSError:  # refused while it is gone, timed out while it is stopped
                self.failures += 1
            self.done.wait(0.003)


def queued_connections(port: int) -> int:
    """The accept queue of the listener on 127.0.0.1:`port` (/proc/net/tcp's rx_queue of a
    LISTEN socket is its count of connections waiting to be accepted)."""
    local = f"0100007F:{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def test_a_server_under_connection_load_checkpoints_and_answers_again(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Connections waiting in the listening socket's accept queue (the kernel completed their
    handshakes, the server has not accepted them) are dropped from the dump (--skip-in-flight):
    CRIU would refuse the dump otherwise ("In-flight connection (l)"). The server stalls (accepts
    nothing) before the checkpoint so that some are surely queued: left to the freeze, whether
    one is depends on where the client's 3 ms loop is (CI once found none)."""
    cg = cgroups.make("server", None)
    port_file = tmp_path / "port"
    stall = tmp_path / "stall"
    server = start_in_cgroup(cg, [sys.executable, str(SERVER), "--port-file", str(port_file),
                                  "--hold", "64", "--stall-file", str(stall)])
    restored = 0
    clients: Clients | None = None
    try:
        assert wait_until(port_file.exists, 10)
        port = int(port_file.read_text())
        clients = Clients(port)
        clients.start()
        assert wait_until(lambda: len(clients.answers) > 50, 20)
        stall.touch()
        failed = clients.failures
        # A connection the client gave up on (0.3 s) stays queued until the server accepts it.
        assert wait_until(lambda: clients.failures > failed, 10)
        assert queued_connections(port) > 0
        done = run_oomguard(store, "checkpoint", str(server.pid))
        assert done.returncode == 0, done.stderr
        assert server.wait(timeout=10) == -signal.SIGKILL
        before = list(clients.answers)
        dump_log = (Store(store).images_of(done.stdout.strip()) / "dump.log").read_text()
        assert "skipping in-flight connection" in dump_log.lower(), "nothing was in flight"

        stall.unlink()
        back = run_oomguard(store, "restore", done.stdout.strip())
        assert back.returncode == 0, back.stderr
        restored = int(back.stdout.strip())
        assert restored == server.pid
        assert wait_until(lambda: len(clients.answers) > len(before) + 20, 20), "no answer"
        after = clients.answers[len(before):]
        # The count went on (a fresh server would start at 1). Counts the client never saw
        # went to connections it gave up on (a slow answer, or one accepted just before the
        # stop): no more of them than its failures.
        assert before[-1] < after[0] <= before[-1] + 1 + clients.failures, (before[-3:], after[:3])
        assert after == list(range(after[0], after[0] + len(after)))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            assert conn.recv(64).split()[1] == b"64"  # its memory came back with it
    finally:
        if clients is not None:
            clients.done.set()
            clients.join(timeout=5)
        kill_pid(restored or server.pid)
        server.wait()


def test_a_log_others_appended_to_meanwhile_is_appended_to_after_their_lines(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A job writing to `>> log` (O_APPEND): CRIU does not pin the size of such a file, so
    lines other writers added while the job was checkpointed stay, and the job writes after
    them."""
    cg = cgroups.make("append", None)
    log = tmp_path / "shared.log"
    script = 'i=0; while :; do i=$((i+1)); echo "job $i"; sleep 0.02; done >> "$0"'
    job = start_in_cgroup(cg, ["/bin/bash", "-c", script, str(log)])
    meta_pids: list[int] = [job.pid]

    def job_counts() -> list[int]:
        lines = log.read_text().splitlines() if log.exists() else []
        return [int(line.split()[1]) for line in lines if line.startswith("job ")]

    try:
        assert wait_until(lambda: len(job_counts()) > 10, 10)
        done = run_oomguard(store, "checkpoint", str(job.pid))
        assert done.returncode == 0, done.stderr
        assert job.wait(timeout=10) == -signal.SIGKILL
        meta_pids = Store(store).get(done.stdout.strip()).pids
        last = job_counts()[-1]
        with open(log, "a") as other:  # another writer, while the job is on disk
            other.writelines(f"other {n}\n" for n in range(1, 6))
        back = run_oomguard(store, "restore", done.stdout.strip())
        assert back.returncode == 0, back.stderr
        assert wait_until(lambda: job_counts()[-1] > last + 10, 10), "the job stopped writing"
        lines = log.read_text().splitlines()
        others = [i for i, line in enumerate(lines) if line.startswith("other ")]
        assert [lines[i] for i in others] == [f"other {n}" for n in range(1, 6)]
        assert lines[others[0] - 1] == f"job {last}"
        assert lines[others[-1] + 1] == f"job {last + 1}"  # after their lines, not over them
        assert job_counts() == list(range(1, len(job_counts()) + 1))
    finally:
        for pid in meta_pids:
            kill_pid(pid)
