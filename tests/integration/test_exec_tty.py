"""`oomguard exec` as people start it: typed on a terminal, redirected into a log file, or a
job that daemonizes; each checkpointed by a real daemon at its cgroup's threshold and restored
with the real CRIU (from no terminal, and from another terminal), then attached to."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.store.checkpoints import Store
from oomguard.terminal.client import request
from oomguard.terminal.execwrap import EXIT_CHECKPOINTED, EXIT_DETACHED
from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    kill_pid,
    oomguard_argv,
    wait_until,
)

pytestmark = pytest.mark.integration
TTY_JOB = REPO / "tests" / "workloads" / "tty_job.py"


def job_argv(log: Path, *, target: int = 160, count: int = 300, daemonize: bool = False,
             ) -> list[str]:
    return [sys.executable, str(TTY_JOB), "--log", str(log), "--target", str(target),
            "--rate", "60", "--count", str(count), "--tick", "0.05",
            *(["--daemonize"] if daemonize else [])]


class Terminal:
    """A pseudo-terminal with a program running on it as its controlling terminal (a person's
    terminal window); everything the program writes is collected."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.master, slave = os.openpty()

        def make_ctty() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=cwd, start_new_session=True, preexec_fn=make_ctty)
        os.close(slave)
        self.output = b""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                ready = select.select([self.master], [], [], 0.2)[0]
                data = os.read(self.master, 65536) if ready else None
            except (OSError, ValueError):
                return
            if data == b"":
                return
            if data:
                with self._lock:
                    self.output += data

    def text(self) -> str:
        with self._lock:
            return self.output.decode(errors="replace")

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait_for(self, needle: str, timeout: float = 30) -> None:
        if not wait_until(lambda: needle in self.text(), timeout):
            raise AssertionError(f"{needle!r} never appeared on the terminal:\n"
                                 f"{self.text()[-2000:]}")

    def close(self) -> None:
        """The window is closed: the terminal hangs up."""
        with contextlib.suppress(OSError):
            os.close(self.master)
        self.master = -1


@pytest.fixture
def runtime_env() -> Iterator[dict[str, str]]:
    """A short XDG_RUNTIME_DIR (socket paths stay under 108 bytes); holders left are ended."""
    directory = Path(tempfile.mkdtemp(prefix="ogt-", dir="/tmp"))
    yield {**os.environ, "XDG_RUNTIME_DIR": str(directory), "PYTHONPATH": str(REPO)}
    for sock in (directory / "oomguard").glob("*.sock"):
        with contextlib.suppress(Exception):
            request(sock, "done", timeout=2, force=True)
    shutil.rmtree(directory, ignore_errors=True)


def counts(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().splitlines() if line.isdigit()]


def done_line(log: Path) -> str | None:
    return next((x for x in log.read_text().splitlines() if x.startswith("done")), None)


def run_cli(store: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(oomguard_argv(store, *args), capture_output=True, text=True,
                          timeout=120, cwd=REPO, stdin=subprocess.DEVNULL, env=env)


def controlling_tty(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[4])


def holder_pid(socket_path: str) -> int:
    return int(request(socket_path, "info")["pid"])


@pytest.mark.parametrize("restore_from", ["no-terminal-through-the-daemon",
                                          "another-terminal-holder-gone"])
def test_terminal_job_restores_anywhere_and_attaches(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, runtime_env: dict[str, str],
        restore_from: str) -> None:
    small = cgroups.make("tty", 128 * MiB)
    big = cgroups.make("ttybig", 512 * MiB)
    log = tmp_path / "job.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        first = Terminal([*oomguard_argv(store), "exec", "--cgroup", str(small.path), "--",
                          *job_argv(log)], runtime_env, tmp_path)
        first.wait_for("count 3")
        first.type(b"before\r")
        first.wait_for("echo: before")
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert first.proc.wait(timeout=30) == EXIT_CHECKPOINTED
        first.wait_for(f"checkpointed as {done['id']}")
        first.close()  # the original terminal goes away
        meta = Store(store).get(done["id"])
        assert meta.pidns and meta.extra["ttys"], meta.extra
        socket_path = meta.extra["ttys"][0]["socket"]
        assert small.snapshot().oom_kills == 0
        before = counts(log)
        assert before == list(range(1, len(before) + 1))

        if restore_from == "no-terminal-through-the-daemon":
            # The daemon restores (a service: no terminal anywhere), the holder still waits.
            result = run_cli(store, "--socket", str(guard.socket), "restore", done["id"],
                             "--cgroup", str(big.path), env=runtime_env)
            assert result.returncode == 0, result.stderr
            assert guard.wait_event("restore.done")
            pid = int(result.stdout.strip())
            viewer = Terminal([*oomguard_argv(store), "attach", done["id"]], runtime_env,
                              tmp_path)
        else:
            holder = holder_pid(socket_path)
            kill_pid(holder)  # the original terminal's holder is killed too (its socket stays)
            assert wait_until(lambda: not Path(f"/proc/{holder}").exists(), 10)
            viewer = Terminal([*oomguard_argv(store), "restore", done["id"], "--cgroup",
                               str(big.path)], runtime_env, tmp_path)
            assert wait_until(lambda: Store(store).get(done["id"]).state == "restored", 60), \
                viewer.text()
            pid = Store(store).get(done["id"]).restored_pid or 0
    try:
        # The namespace's init took the terminal back as its controlling terminal.
        assert wait_until(lambda: controlling_tty(pid) != 0, 10)
        viewer.wait_for(f"count {before[-1] + 5}")  # the job's new output is shown
        viewer.type(b"after\r")
        viewer.wait_for("echo: after")  # and input reaches it
        viewer.type(b"\x1c")  # detach
        assert viewer.proc.wait(timeout=30) == 0
        assert wait_until(lambda: done_line(log), 60) == "done 300 ok"
        assert counts(log) == list(range(1, 301)), "the count restarted or skipped"
        assert "input before" in log.read_text() and "input after" in log.read_text()
        assert "start tty=1" in log.read_text()
    finally:
        kill_pid(pid)
        viewer.close()


def test_redirected_job_log_holds_only_the_jobs_lines(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, runtime_env: dict[str, str]) -> None:
    small = cgroups.make("redir", 128 * MiB)
    big = cgroups.make("redirbig", 512 * MiB)
    job_log = tmp_path / "job.out"
    counter = tmp_path / "counter.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        with open(job_log, "wb") as out:
            wrapper = subprocess.Popen(
                [*oomguard_argv(store), "exec", "--cgroup", str(small.path), "--",
                 *job_argv(counter, count=200)], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, cwd=tmp_path, env=runtime_env,
                start_new_session=True)
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert wrapper.wait(timeout=30) == EXIT_CHECKPOINTED
    n = len(counts(counter))
    expected = "".join(f"count {i}\n" for i in range(1, n + 1))
    assert job_log.read_text() == expected  # nothing of oomguard's, nothing of unshare's
    result = run_cli(store, "restore", done["id"], "--cgroup", str(big.path), env=runtime_env)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: done_line(counter), 60) == "done 200 ok"
        assert job_log.read_text() == "".join(f"count {i}\n" for i in range(1, 201)) \
            + "done 200 ok\n"
    finally:
        kill_pid(pid)


def test_daemonizing_job_survives_and_exec_returns_its_status(
        store: Path, tmp_path: Path, runtime_env: dict[str, str]) -> None:
    log = tmp_path / "d.log"
    result = subprocess.run(
        [*oomguard_argv(store), "exec", "--", "sh", "-c",
         f"(sleep 1; echo child >> {log}) & exit 3"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=runtime_env)
    assert result.returncode == 3  # the job's own status...
    assert log.read_text() == "child\n"  # ...once what it left behind has finished too
    assert result.stdout == "" and result.stderr == ""


def test_daemonized_job_checkpoints_and_restores(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, runtime_env: dict[str, str]) -> None:
    small = cgroups.make("daemonized", 128 * MiB)
    big = cgroups.make("daemonizedbig", 512 * MiB)
    log = tmp_path / "c.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        wrapper = subprocess.Popen(
            [*oomguard_argv(store), "exec", "--cgroup", str(small.path), "--",
             *job_argv(log, count=200, daemonize=True)], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
            env=runtime_env, start_new_session=True)
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert wrapper.wait(timeout=30) == EXIT_CHECKPOINTED
    assert Store(store).get(done["id"]).pidns, "the victim should be the namespace's init"
    result = run_cli(store, "restore", done["id"], "--cgroup", str(big.path), env=runtime_env)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: done_line(log), 60) == "done 200 ok"
        assert counts(log) == list(range(1, 201))
        # The namespace's init outlived the job's first process and ends with the last one.
        assert wait_until(lambda: not Path(f"/proc/{pid}").exists()
                          or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], 30)
    finally:
        kill_pid(pid)


def test_attach_without_a_holder_says_why(store: Path, runtime_env: dict[str, str]) -> None:
    result = run_cli(store, "attach", str(os.getpid()), env=runtime_env)
    assert result.returncode == 1
    assert "has no terminal oomguard holds" in result.stderr



def test_closing_the_terminal_leaves_the_job_running_and_attachable_by_pid(
        store: Path, tmp_path: Path, runtime_env: dict[str, str]) -> None:
    """Ctrl-Z does not leave the job stopped; the terminal window is closed while the job
    runs: exec says it detached (76), the job does not die of SIGHUP (its terminal is the
    holder's pty), and `attach PID` finds it."""
    log = tmp_path / "job.log"
    first = Terminal([*oomguard_argv(store), "exec", "--", *job_argv(log, target=8, count=400)],
                     runtime_env, tmp_path)
    try:
        first.wait_for("count 3")
        first.type(b"\x1a")  # Ctrl-Z: nothing could continue the job, so it is not stopped
        first.wait_for(f"count {len(counts(log)) + 3}")
        first.close()
        assert first.proc.wait(timeout=30) == EXIT_DETACHED
        init = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_init_of(p, log))
        seen = len(counts(log))
        assert wait_until(lambda: len(counts(log)) > seen + 5, 30), "the job stopped counting"
        viewer = Terminal([*oomguard_argv(store), "attach", str(init)], runtime_env, tmp_path)
        viewer.wait_for(f"count {len(counts(log)) + 3}")
        viewer.type(b"still here\r")
        viewer.wait_for("echo: still here")
        viewer.type(b"\x1c")
        assert viewer.proc.wait(timeout=30) == 0
        assert wait_until(lambda: done_line(log), 60) == "done 400 ok"
    finally:
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_init_of(p, log)]:
            kill_pid(pid)  # the init; its job dies with the namespace


def _is_init_of(pid: str, log: Path) -> bool:
    """The namespace's init (oomguard/terminal/nsinit.py) of the job writing `log`."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.endswith(b"nsinit.py") for arg in cmdline) and str(log).encode() in cmdline


def _job_typed_and_checkpointed(guard: DaemonProcess, store: Path, cgroup: MemoryCgroup,
                                log: Path, env: dict[str, str],
                                tmp_path: Path) -> tuple[dict[str, Any], Terminal]:
    """A 200-count job run with `oomguard exec` on a terminal, checkpointed by the guard."""
    first = Terminal([*oomguard_argv(store), "exec", "--cgroup", str(cgroup.path), "--",
                      *job_argv(log, count=200)], env, tmp_path)
    done = guard.wait_event("checkpoint.done", timeout=60)[0]
    assert first.proc.wait(timeout=30) == EXIT_CHECKPOINTED
    return done, first


def test_failed_restore_leaves_checkpoint_and_terminal_restorable(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, runtime_env: dict[str, str]) -> None:
    small = cgroups.make("ttyfail", 128 * MiB)
    big = cgroups.make("ttyfailbig", 512 * MiB)
    log = tmp_path / "job.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        done, first = _job_typed_and_checkpointed(guard, store, small, log, runtime_env, tmp_path)
    first.close()
    broken = tmp_path / "criu-broken"  # a CRIU that is new enough but fails every restore
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Version: 4.2.1" && exit 0\n'
                      'echo "Error (criu/cr-restore.c:1): broken on purpose" >&2\nexit 1\n')
    broken.chmod(0o755)
    failed = run_cli(store, "restore", done["id"], "--cgroup", str(big.path), "--criu",
                     str(broken), env=runtime_env)
    assert failed.returncode == 1
    assert "the checkpoint is intact" in failed.stderr
    assert Store(store).get(done["id"]).state == "checkpointed"
    socket_path = Store(store).get(done["id"]).extra["ttys"][0]["socket"]
    assert request(socket_path, "info")["pinned"] == done["id"]  # the holder waits on
    result = run_cli(store, "restore", done["id"], "--cgroup", str(big.path), env=runtime_env)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: done_line(log), 60) == "done 200 ok"
        assert counts(log) == list(range(1, 201))
    finally:
        kill_pid(pid)


def test_holder_keeps_a_vacated_terminal_only_when_pinned(runtime_env: dict[str, str]) -> None:
    """A holder whose terminal every process closed ends after its grace unless a checkpoint
    pinned it; pinned, it waits for the restore and hands out the same terminal."""
    from oomguard.terminal.client import listen_at, new_socket_path, request_slave, spawn_holder

    directory = Path(runtime_env["XDG_RUNTIME_DIR"]) / "oomguard"
    paths = []
    for pin in (False, True):
        master, slave = os.openpty()
        path = new_socket_path(directory)
        with listen_at(path, os.getuid(), os.getgid()) as listener:
            spawn_holder(master, listener, grace=1.0)
        os.close(master)
        key = request(path, "info")["key"]
        if pin:
            assert request(path, "pin", id="cp-1") == {}
        os.close(slave)  # the job is gone (ended, or dumped and killed)
        paths.append((path, key))
    unpinned, pinned = paths
    assert wait_until(lambda: not unpinned[0].exists(), 30), "the holder never ended"
    time.sleep(2)  # past the grace: the pinned one must still be there
    info = request(pinned[0], "info")
    assert info["pinned"] == "cp-1" and info["vacant"]
    fd, answer = request_slave(pinned[0])
    try:
        st = os.fstat(fd)
        assert answer["key"] == pinned[1] == f"tty[{st.st_rdev:x}:{st.st_dev:x}]"
    finally:
        os.close(fd)
    assert request(pinned[0], "done") == {}  # a pinned terminal waits for its restore...
    assert request(pinned[0], "info")["pinned"] == "cp-1"
    assert request(pinned[0], "done", force=True) == {}  # ...unless told to end
    assert wait_until(lambda: not pinned[0].exists(), 30)


def _answers(socket_path: str) -> bool:
    try:
        request(socket_path, "info", timeout=2)
    except Exception:
        return False
    return True


def _terminal_fds(pid: int) -> int:
    """How many of the process's fds are terminals (a pty's master or slave)."""
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            found += target == "/dev/ptmx" or target.startswith("/dev/pts/")
    return found


def test_a_restore_failing_after_its_terminal_was_leased_gives_it_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, runtime_env: dict[str, str]) -> None:
    """A restore that fails after the job's terminal was leased, with an error that is not
    CRIU's (an OSError: here the hook CRIU would run cannot be read; a full disk when it is
    rewritten, the same): the daemon kept the leased pty's fds for good, and the holder
    started for the restore went on serving a terminal no job would ever have. Now every
    failure once the terminal is leased gives it back, as a failed CRIU does."""
    small = cgroups.make("ttylease", 128 * MiB)
    big = cgroups.make("ttyleasebig", 512 * MiB)
    log = tmp_path / "job.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        guard.wait_event("guard.armed")
        done, first = _job_typed_and_checkpointed(guard, store, small, log, runtime_env, tmp_path)
        first.close()
        socket_path = Store(store).get(done["id"]).extra["ttys"][0]["socket"]
        holder = holder_pid(socket_path)
        kill_pid(holder)  # the terminal's holder is gone: the restore starts a new one
        assert wait_until(lambda: not Path(f"/proc/{holder}").exists(), 10)
        hook = store / ".hooks" / "criu-post-dump"
        hook.unlink()
        hook.mkdir()  # read as the hook: IsADirectoryError
        ptys = _terminal_fds(guard.handle.pid)
        failed = run_cli(store, "--socket", str(guard.socket), "restore", done["id"],
                         "--cgroup", str(big.path), env=runtime_env)
        assert failed.returncode != 0 and "Is a directory" in failed.stderr, failed.stderr
        assert guard.wait_event("restore.failed")
        assert Store(store).get(done["id"]).state == "checkpointed"
        assert _terminal_fds(guard.handle.pid) == ptys, "the leased terminal stayed open"
        assert wait_until(lambda: not _answers(socket_path), 30), \
            "the holder started for the failed restore still serves its terminal"
        hook.rmdir()
        result = run_cli(store, "--socket", str(guard.socket), "restore", done["id"],
                         "--cgroup", str(big.path), env=runtime_env)
        assert result.returncode == 0, result.stderr
        pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: done_line(log), 60) == "done 200 ok"
        assert counts(log) == list(range(1, 201)), "the count restarted or skipped"
    finally:
        kill_pid(pid)
