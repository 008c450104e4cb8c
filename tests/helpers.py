"""Shared helpers for the real-kernel tests: cgroups beneath our own, hogs, the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.mounts import open_cgroup, read_layout
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.sense.procfs import ProcReader, parse_memory_cgroup

REPO = Path(__file__).resolve().parents[1]
HOG = REPO / "tests" / "workloads" / "hog.py"
MiB = 1 << 20


def own_v1_memory_cgroup() -> V1MemoryCgroup | None:
    """This process's v1 memory cgroup: the only place tests may create cgroups."""
    layout = read_layout()
    if layout.memory_v1 is None:
        return None
    rel = parse_memory_cgroup(Path("/proc/self/cgroup").read_text()) or "/"
    return V1MemoryCgroup(layout.memory_v1 / rel.lstrip("/"), layout.memory_v1)


def own_memory_cgroup() -> MemoryCgroup | None:
    """This process's memory cgroup, v1 or v2 (the VM lane)."""
    layout = read_layout()
    if layout.memory_mount is None:
        return None
    rel = parse_memory_cgroup(Path("/proc/self/cgroup").read_text()) or "/"
    return open_cgroup(rel, layout)


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def proc_state(pid: int) -> str | None:
    try:
        return ProcReader().state(pid)
    except Exception:
        return None


# Inside the v2 VM lane (qemu's software emulation, the host's root over 9p) a daemon's first
# start alone can take tens of seconds: waits for its events are stretched there.
EMULATION_FACTOR = 3 if os.environ.get("OOMGUARD_VM") == "1" else 1
# On cgroup v2 the guard's own memory.high throttles a hog that crosses it, and the kernel stops
# or freezes a throttled task only once its penalty is slept out: at most 2 s
# (MEMCG_MAX_HIGH_DELAY_JIFFIES, mm/memcontrol.c).
HIGH_PENALTY_MAX_MS = 2000


def read_counts(log: Path) -> list[int]:
    """The counts a hog wrote (first field of each line; 'done' lines excluded)."""
    if not log.exists():
        return []
    counts = []
    for line in log.read_text().splitlines():
        head = line.split(" ", 1)[0]
        if head.isdigit():
            counts.append(int(head))
    return counts


def last_count(log: Path) -> int:
    counts = read_counts(log)
    return counts[-1] if counts else 0


class KeptLog:
    """A logger that keeps what it is told, (event, fields), for a daemon object in a test."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.seen.append((event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.seen if name == event]


@dataclass
class CgroupFactory:
    """Creates memory cgroups beneath the test's own; removes them (and kills what is left in
    them: only processes these tests started or restored) afterwards."""

    parent: MemoryCgroup
    tag: str
    created: list[MemoryCgroup] = field(default_factory=list)

    def make(self, name: str, limit: int | None) -> MemoryCgroup:
        cg = self.parent.child(f"oomguard-test-{self.tag}-{name}")
        cg.create()
        if limit is not None:
            cg.set_limit(limit)
        self.created.append(cg)
        return cg

    def cleanup(self) -> None:
        for cg in reversed(self.created):
            for _ in range(100):
                try:
                    pids = cg.procs()
                except Exception:
                    break
                if not pids:
                    break
                for pid in pids:
                    kill_pid(pid)
                time.sleep(0.05)
            for _ in range(50):
                try:
                    cg.path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def start_in_cgroup(cgroup: MemoryCgroup | None, argv: list[str], *,
                    log: Path | None = None, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start argv inside `cgroup` (the shell moves itself in, then execs), stdio off pipes:
    a pipe to a reader outside the tree would not survive a checkpoint. Each job is its own
    session leader (setsid), as one started by systemd, Slurm or a container runtime is: the
    test runner's session may belong to an outer PID namespace, which CRIU cannot dump."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    if cgroup is None:
        full = argv
    else:
        full = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.path / "cgroup.procs"),
                *argv]
    try:
        return subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=cwd,
                                start_new_session=True)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


def hog_argv(log: Path, *, target: int, rate: float, count: int, tick: float = 0.02,
             children: int = 0, chunk: int = 4) -> list[str]:
    return [sys.executable, str(HOG), "--log", str(log), "--target", str(target), "--rate",
            str(rate), "--count", str(count), "--tick", str(tick), "--children", str(children),
            "--chunk", str(chunk)]


def oomguard_argv(store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "oomguard", "--store", str(store), "--log-format", "json", *args]


def run_oomguard(store: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(oomguard_argv(store, *args), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def parse_events(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def short_socket_path() -> Path:
    """A control socket path well under the 108-byte limit of sun_path."""
    return Path(tempfile.mkdtemp(prefix="og-", dir="/tmp")) / "control.sock"


def cli_argv(*args: str) -> list[str]:
    """The CLI with neither --store nor --socket: where it looks comes from its config."""
    return [sys.executable, "-m", "oomguard", "--log-format", "json", *args]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            as_user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """cli_argv(*args) run to its end; `as_user`: a prefix such as setpriv's."""
    return subprocess.run([*(as_user or []), *cli_argv(*args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL, env=env)


class DaemonProcess:
    """`oomguard run` as a real process, its JSON log in a file, its own control socket.
    With `config`: `oomguard --config FILE run`, and the store and the socket are the
    config's (pass the config's socket as `socket`, so that stop() can tidy it)."""

    def __init__(self, store: Path, log: Path, *args: str, socket: Path | None = None,
                 env: dict[str, str] | None = None, config: Path | None = None,
                 wrapper: tuple[str, ...] = (), log_level: str = "info") -> None:
        self.log = log
        self.socket = socket or short_socket_path()
        level = ("--log-level", log_level)
        argv = oomguard_argv(store, *level, "--socket", str(self.socket), "run", *args) \
            if config is None else cli_argv(*level, "--config", str(config), "run", *args)
        self.handle = subprocess.Popen([*wrapper, *argv], cwd=REPO, env=env,
                                       stdin=subprocess.DEVNULL, stdout=open(log, "ab"),  # noqa: SIM115
                                       stderr=subprocess.STDOUT)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = parse_events(self.log.read_text()) if self.log.exists() else []
        return [e for e in found if name is None or e.get("event") == name]

    def wait_event(self, name: str, timeout: float = 30, count: int = 1) -> list[dict[str, Any]]:
        timeout *= EMULATION_FACTOR
        found = wait_until(lambda: len(self.events(name)) >= count and self.events(name), timeout)
        if not found or len(found) < count:
            raise AssertionError(f"no {name!r} event within {timeout}s; log:\n"
                                 f"{self.log.read_text()[-4000:]}")
        return list(found)

    def stop(self) -> int:
        if self.handle.poll() is None:
            self.handle.send_signal(signal.SIGTERM)
            try:
                self.handle.wait(timeout=30 * EMULATION_FACTOR)  # a clean stop puts back
            except subprocess.TimeoutExpired:
                self.handle.kill()
                self.handle.wait()
        if self.socket.parent.name.startswith("og-"):
            shutil.rmtree(self.socket.parent, ignore_errors=True)
        return self.handle.returncode


@contextlib.contextmanager
def daemon(store: Path, log: Path, *args: str, socket: Path | None = None,
           env: dict[str, str] | None = None,
           config: Path | None = None) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(store, log, *args, socket=socket, env=env, config=config)
    try:
        yield proc
    finally:
        proc.stop()


def run_vm_lane(command: list[str], timeout: int, skip_codes: tuple[int, ...] = (77,),
                ) -> tuple[subprocess.CompletedProcess[str], float]:
    """`command` in one VM of the cgroup v2 lane (scripts/vm-lane); returns the result and its
    wall time. Exits the test as skipped, with the reason, on `skip_codes` (77: the lane
    could not be set up; a command may add its own "cannot run here" status)."""
    import pytest

    argv = [str(REPO / "scripts" / "vm-lane"), "run", "--timeout", str(timeout), "--", *command]
    start = time.monotonic()
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                            timeout=timeout + 300, stdin=subprocess.DEVNULL,
                            env={**os.environ, "OOMGUARD_IN_VM_LANE": "1"})
    if result.returncode in skip_codes:
        output = result.stdout + result.stderr
        reason = next((line for line in output.splitlines() if "SKIP" in line), output[-300:])
        pytest.skip(f"VM lane unavailable: {reason}")
    return result, time.monotonic() - start


def unprivileged_user(name: str, uid: int) -> int:
    """A real unprivileged user for attack tests: made with useradd (no home, no login shell)
    the first time, kept afterwards; where /etc is read-only (the VM lane) the bare uid, which
    the kernel treats the same. Returns the uid."""
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        pass
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                           "/usr/sbin/nologin", "--uid", str(uid), "--user-group", name],
                          capture_output=True, text=True, check=False)
    if made.returncode == 0:
        return pwd.getpwnam(name).pw_uid
    return uid


def checkpoint_through_socket(sock: Path, pid: int) -> subprocess.Popen[bytes]:
    """A Checkpoint call for `pid` on the daemon's socket, left running (a test kills the
    daemon under it): its answer is not read."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from oomguard.control.client import "
         "ControlClient as C; C(__import__('pathlib').Path(sys.argv[1]))"
         ".call('Checkpoint', pid=int(sys.argv[2]))", str(sock), str(pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def outside_server(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A Unix stream server outside any job, bound at `path` and accepting in a thread: a job
    connected to it holds a connection CRIU cannot dump. Returns it and what it accepted."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return server, accepted


def close_server(server: socket.socket, accepted: list[socket.socket]) -> None:
    """outside_server's server and what it accepted, closed."""
    server.close()
    for conn in accepted:
        conn.close()


def as_user(uid: int) -> list[str]:
    """The argv prefix that runs a command as `uid` (its group the same), no other groups."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def users_workdir(uid: int, prefix: str) -> Path:
    """A directory under /tmp that `uid` owns (mode 0755), for an attacker's files; the
    caller removes it (request.addfinalizer)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    workdir.chmod(0o755)
    os.chown(workdir, uid, uid)
    return workdir
