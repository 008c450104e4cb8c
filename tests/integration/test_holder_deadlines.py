"""Sockets a user controls, named like terminal holders, as the attacker used them: one that
accepts and trickles a byte a second does not hold a checkpoint (nor its lifted limit) for
more than its deadline, and `oomguard attach PID` attaches only to that process's own holder,
never to another holder of the same user that the process's environment names."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.sense.psi import has_cap_sys_resource
from oomguard.store.checkpoints import Store
from oomguard.terminal.client import (
    NOTIFY_DEADLINE,
    listen_at,
    new_socket_path,
    request,
    spawn_holder,
)
from oomguard.terminal.commands import holder_of_pid
from oomguard.terminal.external import SOCKET_ENV
from tests.helpers import (
    EMULATION_FACTOR,
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration
TRICKSTER = ("oomguard-t-trickster", 40280)

# Serves a listening socket (bound here at argv[1], or inherited as fd argv[2]): every
# connection is sent a byte a second, never a whole line, for up to 120 s; when its peer
# closes it, prints {"held": seconds from accept to the peer's close}.
TRICKLER = r"""
import json, os, select, socket, sys, threading, time
if len(sys.argv) > 2:
    listener = socket.socket(fileno=int(sys.argv[2]))
else:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(8)
print("listening", flush=True)
def serve(conn, accepted):
    with conn:
        closed = False
        while not closed and time.monotonic() - accepted < 120:
            try:
                conn.send(b" ")
            except OSError:
                break
            end = time.monotonic() + 1.0
            while (left := end - time.monotonic()) > 0:
                if select.select([conn], [], [], left)[0]:
                    try:
                        data = conn.recv(4096)
                    except OSError:
                        data = b""
                    if not data:
                        closed = True
                        break
        print(json.dumps({"held": time.monotonic() - accepted}), flush=True)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn, time.monotonic())).start()
"""


def as_user(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


_READ: dict[int, bytes] = {}  # what was read of a process's stdout past its last whole line


def _lines(proc: subprocess.Popen[bytes], count: int, timeout: float) -> list[str]:
    """The next `count` lines `proc` writes, all within `timeout` seconds."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = _READ.pop(fd, b"")
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while data.count(b"\n") < count:
            if not sel.select(timeout):
                raise AssertionError(f"not {count} lines within {timeout}s: {data!r}")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(proc.stderr.read() if proc.stderr else "ended")
            data += chunk
    lines = data.split(b"\n")
    _READ[fd] = b"\n".join(lines[count:])
    return [line.decode() for line in lines[:count]]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short directory under /tmp (socket paths stay under 108 bytes) a user may enter."""
    path = Path(tempfile.mkdtemp(prefix="ogh-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("owner", [
    "root",
    pytest.param("user", marks=pytest.mark.skipif(
        not has_cap_sys_resource(Path("/proc/self/status").read_text()),
        reason="root here lacks CAP_SYS_RESOURCE, so CRIU cannot dump another user's "
               "process; this case runs in the v2 VM lane, where root has it")),
])
def test_a_trickling_holder_socket_holds_a_checkpoint_no_longer_than_its_deadline(
        owner: str, cgroups: CgroupFactory, store: Path, tmp_path: Path,
        workdir: Path) -> None:
    """The job's environment names a holder socket of the user's: it accepts, then trickles a
    byte a second and never answers. The guard's checkpoint of the job completes all the
    same, each notification given up on at its deadline; the limit is the cgroup's own."""
    uid = unprivileged_user(*TRICKSTER)
    limit = 256 * MiB
    cg = cgroups.make("trickled", limit)
    path = new_socket_path(workdir)
    job_user: list[str] = []
    listener: socket.socket | None = None
    if owner == "user":  # the user's job, the user's socket, in a directory of theirs
        os.chown(workdir, uid, uid)
        job_user = as_user(uid)
        trickler = subprocess.Popen([*as_user(uid), sys.executable, "-c", TRICKLER, str(path)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, cwd="/",
                                    env={"PATH": os.environ["PATH"]})
    else:  # root's job: its holder socket is root's, served by the user's trickler
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)
        trickler = subprocess.Popen([*as_user(uid), sys.executable, "-c", TRICKLER, str(path),
                                     str(listener.fileno())], pass_fds=(listener.fileno(),),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, cwd="/",
                                    env={"PATH": os.environ["PATH"]})
        listener.close()
    master, slave = os.openpty()  # the job's terminal, its master held here (outside the tree)
    job: subprocess.Popen[bytes] | None = None
    try:
        assert _lines(trickler, 1, 30) == ["listening"]
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
            guard.wait_event("guard.armed")
            # The job leads its own session on that terminal, names the socket, and grows
            # past the threshold.
            log = workdir / "hog.log"
            job = subprocess.Popen(
                ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.path / "cgroup.procs"),
                 "setsid", "--ctty", *job_user,
                 *hog_argv(log, target=400, rate=300, count=100_000)],
                stdin=slave, stdout=slave, stderr=slave, cwd="/",
                env={"PATH": os.environ["PATH"], SOCKET_ENV: str(path)})
            done = guard.wait_event("checkpoint.done", timeout=90)[0]
            assert done["pid"] == job.pid
            job.wait(timeout=10)  # dumped: CRIU ended it
            meta = Store(store).get(done["id"])
            assert [t["socket"] for t in meta.extra["ttys"]] == [str(path)]  # it was told
            assert cg.limit() == limit  # put back
            assert cg.snapshot().oom_kills == 0
            # Each of the daemon's connections (dumping, then pin) was given up on at its
            # deadline: not held for the trickle.
            held = [json.loads(line)["held"] for line in _lines(trickler, 2, 30)]
            assert all(h <= NOTIFY_DEADLINE + 1.0 * EMULATION_FACTOR for h in held), held
            # And the dump waited for it (the room lifted) no longer than its deadline.
            assert done["holders_s"] <= NOTIFY_DEADLINE + 0.2 + 0.3 * EMULATION_FACTOR, done
    finally:
        if job is not None and job.poll() is None:
            kill_pid(job.pid)
            job.wait()
        trickler.kill()
        trickler.wait()
        os.close(master)
        os.close(slave)


# Holds the terminal fd argv[1] at fd 5 only (stdio on /dev/null), then waits.
MOVE_TO_FD5 = "import os, sys, time; fd = int(sys.argv[1]); os.dup2(fd, 5); os.close(fd); " \
              "time.sleep(60)"


def _pts_on_fd5_only(pid: int, old: int) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        return os.readlink(fds / "5").startswith("/dev/pts/") and not (fds / str(old)).exists()
    return False


def _start_holder(directory: Path, uid: int, marker: bytes) -> tuple[str, int]:
    """A real pty holder of the user's in `directory`, its pty's scrollback holding `marker`;
    (its socket, a slave fd of its pty)."""
    master, slave = os.openpty()
    path = new_socket_path(directory)
    listener = listen_at(path, uid, uid)
    try:
        os.fchown(slave, uid, uid)
        os.write(slave, marker + b"\r\n")
        spawn_holder(master, listener, uid=uid, gid=uid)
    finally:
        listener.close()
        os.close(master)
    assert request(path, "info")["key"]  # it answers
    return str(path), slave


def test_attach_pid_uses_that_processes_own_holder_never_another_of_the_same_user(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uid = unprivileged_user(*TRICKSTER)
    os.chown(workdir, uid, uid)
    runtime = workdir / "oomguard"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, uid, uid)
    holders: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    slaves: list[int] = []
    try:
        mine, slave_a = _start_holder(runtime, uid, b"this is terminal A")
        other, slave_b = _start_holder(runtime, uid, b"this is terminal B")
        holders += [mine, other]
        slaves += [slave_a, slave_b]
        env = {"PATH": os.environ["PATH"], SOCKET_ENV: other}  # names the other holder
        # No terminal at all: refused, never the holder its environment names.
        bare = subprocess.Popen([*as_user(uid), "sleep", "60"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        # On terminal A (stdio), and on terminal A at fd 5 only: A's holder, not B's.
        on_a = subprocess.Popen([*as_user(uid), "sleep", "60"], stdin=slave_a, stdout=slave_a,
                                stderr=slave_a, env=env)
        fd_a = subprocess.Popen([*as_user(uid), sys.executable, "-c", MOVE_TO_FD5, str(slave_a)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, pass_fds=(slave_a,))
        procs += [bare, on_a, fd_a]
        assert wait_until(lambda: _pts_on_fd5_only(fd_a.pid, slave_a), 30)
        user_env = {**env, "XDG_RUNTIME_DIR": str(workdir), "PYTHONPATH": str(REPO)}
        refused = subprocess.run([*as_user(uid), sys.executable, "-m", "oomguard", "attach",
                                  str(bare.pid)], capture_output=True, text=True, timeout=60,
                                 cwd="/", stdin=subprocess.DEVNULL, env=user_env)
        assert refused.returncode == 1, (refused.stdout, refused.stderr)
        assert "has no terminal oomguard holds" in refused.stderr
        assert "this is terminal B" not in refused.stdout
        # The user's own CLI, attached to the process on A: A's scrollback, never B's.
        viewer = subprocess.Popen([*as_user(uid), sys.executable, "-m", "oomguard", "attach",
                                   str(on_a.pid)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, cwd="/", stdin=subprocess.DEVNULL,
                                  env=user_env)
        try:
            seen = _read_until(viewer, b"this is terminal", 60)
            assert b"this is terminal A" in seen and b"terminal B" not in seen, seen
        finally:
            viewer.kill()
            viewer.wait()
        # And the lookup itself, for the process holding A at fd 5 only too.
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(workdir))
        assert holder_of_pid(fd_a.pid) == mine
        assert holder_of_pid(on_a.pid) == mine
        assert holder_of_pid(bare.pid) is None
    finally:
        for proc in procs:
            kill_pid(proc.pid)
            proc.wait()
        for path in holders:
            with contextlib.suppress(Exception):
                request(path, "done", timeout=2, force=True)
        for fd in slaves:
            os.close(fd)


def _read_until(proc: subprocess.Popen[bytes], needle: bytes, timeout: float) -> bytes:
    assert proc.stdout is not None
    seen = b""
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while needle not in seen:
            if not sel.select(timeout):
                raise AssertionError(f"no {needle!r} within {timeout}s: {seen!r}")
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
    return seen
