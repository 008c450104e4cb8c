"""`oomguard exec -- CMD`: start a workload under a minimal init (oomguard/terminal/nsinit.py) as PID 1
of its own PID namespace, in a session of its own, so its checkpoint always restores (CRIU
restores PIDs; inside a fresh namespace they are always free). A job started on a terminal
gets a pty owned by a holder outside its tree (oomguard/terminal/holder.py) instead, so it can be
restored and attached to from anywhere. This process stays outside the namespace, writes
nothing on the job's streams, and exits with the job's status, or EXIT_CHECKPOINTED."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import subprocess
import sys
import syslog
import termios
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from oomguard.model.errors import BadInput
from oomguard.sense.fdwait import wait_readable
from oomguard.terminal.attach import (
    CLIENT_SIGNALS,
    DETACHED,
    ENDED,
    GONE,
    HANGUP,
    PINNED,
    JobClient,
)
from oomguard.terminal.client import (
    connect_attach,
    listen_at,
    new_socket_path,
    notify,
    runtime_dir,
    spawn_holder,
)
from oomguard.terminal.external import SOCKET_ENV
from oomguard.terminal.userterm import in_foreground, signal_wakeups

NSINIT = Path(__file__).with_name("nsinit.py")
CLONE_NEWPID = 0x20000000
EXIT_CHECKPOINTED = 75  # the job was checkpointed (its id is reported); `oomguard restore ID`
EXIT_DETACHED = 76  # a terminal job runs on without us (detached, or our terminal is gone)
EXIT_NOT_FOUND = 127
EXIT_NO_CGROUP = 125  # nsinit could not join --cgroup (it says nothing on the job's streams)
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
CHILD = "child"


def nsinit_argv(command: Sequence[str], *, tty_fd: int | None = None,
                cgroup_procs: Path | None = None, python: str = sys.executable) -> list[str]:
    argv = [python, "-I", str(NSINIT)]
    if tty_fd is not None:
        argv += ["--tty-fd", str(tty_fd)]
    if cgroup_procs is not None:
        argv += ["--cgroup-procs", str(cgroup_procs)]
    return [*argv, "--", *command]


def exit_status(returncode: int) -> int:
    """Popen's returncode as a shell reports it (a signal N is 128+N)."""
    return returncode if returncode >= 0 else 128 - returncode


class NoNamespace(BadInput):
    """This process may not make a PID namespace (it lacks CAP_SYS_ADMIN): nothing started."""


CAP_SYS_ADMIN = 21


def may_make_pid_namespace(status: str | None = None) -> bool:
    """Whether unshare(CLONE_NEWPID) is allowed here: CAP_SYS_ADMIN in the effective set
    (/proc/self/status CapEff), asked before anything is started (a terminal's holder)."""
    try:
        text = status if status is not None else Path("/proc/self/status").read_text()
        caps = next(int(line.split()[1], 16) for line in text.splitlines()
                    if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return True  # cannot tell: unshare itself says so
    return bool(caps >> CAP_SYS_ADMIN & 1)


def unshare_pid_namespace() -> None:
    """Our next child becomes PID 1 of a new PID namespace (we stay where we are)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        if err == errno.EPERM:
            raise NoNamespace("a PID namespace of its own for the job needs root "
                              "(CAP_SYS_ADMIN); nothing was started")
        raise OSError(err, f"unshare(CLONE_NEWPID): {os.strerror(err)}")


def report(message: str) -> None:
    """To the user's terminal when stderr is one (never the job's: a terminal job has a pty of
    its own), else to syslog (the journal): the job's log files stay the job's."""
    if os.isatty(2):
        with contextlib.suppress(OSError):  # a terminal that hung up goes on to syslog
            os.write(2, f"oomguard: {message}\n".encode())
            return
    syslog.openlog("oomguard-exec", syslog.LOG_PID, syslog.LOG_USER)
    syslog.syslog(syslog.LOG_NOTICE, message)


def _copy_terminal(src: int, dst: int) -> None:
    try:
        termios.tcsetattr(dst, termios.TCSANOW, termios.tcgetattr(src))
        termios.tcsetwinsize(dst, termios.tcgetwinsize(src))
    except (OSError, termios.error):
        pass


@dataclass
class ExecJob:
    command: list[str]
    cgroup_procs: Path | None = None
    # The checkpoint id of a tree rooted at this host pid, if one was just taken.
    find_checkpoint: Callable[[int], str | None] = lambda _pid: None
    say: Callable[[str], None] = report

    def run(self) -> int:
        if shutil.which(self.command[0]) is None:
            self.say(f"exec: {self.command[0]}: command not found")
            return EXIT_NOT_FOUND
        if not may_make_pid_namespace():
            raise NoNamespace("a PID namespace of its own for the job needs root "
                              "(CAP_SYS_ADMIN); nothing was started")
        tty_fds = [fd for fd in (0, 1, 2) if os.isatty(fd)]
        return self._run_tty(tty_fds) if tty_fds else self._run_plain()

    def _spawn(self, stdio: dict[int, int], env: dict[str, str] | None,
               tty_fd: int | None) -> subprocess.Popen[bytes]:
        unshare_pid_namespace()
        return subprocess.Popen(
            nsinit_argv(self.command, tty_fd=tty_fd, cgroup_procs=self.cgroup_procs),
            stdin=stdio.get(0), stdout=stdio.get(1), stderr=stdio.get(2), env=env,
            start_new_session=True, pass_fds=() if tty_fd is None else (tty_fd,))

    def _ended(self, proc: subprocess.Popen[bytes]) -> tuple[int, str | None, str | None]:
        """(exit status, checkpoint id, what to tell) once the namespace's init is gone. CRIU
        kills a dumped tree with SIGKILL; the store then says whether it was a checkpoint."""
        code = proc.wait()
        if code == -signal.SIGKILL:
            checkpoint_id = self.find_checkpoint(proc.pid)
            if checkpoint_id is not None:
                return EXIT_CHECKPOINTED, checkpoint_id, (
                    f"job {proc.pid} checkpointed as {checkpoint_id}; "
                    f"bring it back with `oomguard restore {checkpoint_id}`")
            return exit_status(code), None, f"job {proc.pid} was killed (SIGKILL)"
        if code == EXIT_NO_CGROUP and self.cgroup_procs is not None:
            return code, None, f"the job could not join {self.cgroup_procs.parent}"
        return exit_status(code), None, None

    def _finish(self, proc: subprocess.Popen[bytes]) -> int:
        status, _checkpoint_id, message = self._ended(proc)
        if message:
            self.say(message)
        return status

    def _run_plain(self) -> int:
        with signal_wakeups((signal.SIGCHLD, signal.SIGHUP, *FORWARD)) as wake:
            proc = self._spawn({}, None, None)
            while proc.poll() is None:
                for sig in os.read(wake, 64) if _readable(wake) else b"":
                    if sig != signal.SIGCHLD:
                        _forward(proc, sig)
        return self._finish(proc)

    def _run_tty(self, tty_fds: list[int]) -> int:
        master, slave = os.openpty()
        _copy_terminal(tty_fds[0], slave)
        path = new_socket_path(runtime_dir(os.getuid()))
        listener = listen_at(path, os.getuid(), os.getgid())
        try:
            spawn_holder(master, listener)
        finally:
            os.close(master)
            listener.close()
        env = {**os.environ, SOCKET_ENV: str(path)}
        sock, info = connect_attach(path)
        stdin_fd = 0 if 0 in tty_fds else None
        out_fd = next(fd for fd in (1, 2, 0) if fd in tty_fds)
        with sock, signal_wakeups((*CLIENT_SIGNALS, signal.SIGCHLD, *FORWARD)) as wake:
            proc = self._spawn({fd: slave for fd in tty_fds}, env, slave)
            os.close(slave)

            def on_signal(sig: int) -> str | None:
                if sig == signal.SIGCHLD:
                    return CHILD if proc.poll() is not None else ""
                if sig == signal.SIGHUP:
                    return DETACHED  # our terminal is gone; the job's is the holder's
                if sig == signal.SIGQUIT and in_foreground(stdin_fd):
                    return None  # Ctrl-\ on the user's terminal: the client detaches
                if sig in FORWARD and sig != signal.SIGTSTP:
                    _forward(proc, sig)
                    return ""
                return None

            client = JobClient(sock, info, stdin_fd, out_fd, wake, on_signal, say=self.say)
            why = client.run()
            if why == PINNED and client.state.pinned:
                proc.wait()
                self.say(f"job {proc.pid} checkpointed as {client.state.pinned}; "
                         f"bring it back with `oomguard restore {client.state.pinned}`")
                return EXIT_CHECKPOINTED
            if why in (ENDED, GONE):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2.0)  # the holder went first: the job's end follows
            if proc.poll() is not None:
                status, checkpoint_id, message = self._ended(proc)
                if checkpoint_id is not None:
                    notify(str(path), "pin", id=checkpoint_id)
                else:
                    code = proc.returncode
                    notify(str(path), "done", **({"signal": -code} if code < 0
                                                  else {"status": code}))
                    client.drain()
                if message:
                    self.say(message)
                return status
        if why == HANGUP:
            self.say(f"the terminal hung up; the job runs on (pid {proc.pid}): "
                     f"`oomguard attach {proc.pid}`")
        elif why in (ENDED, GONE):
            self.say(f"the job's terminal holder ended; the job (pid {proc.pid}) is on its own")
        else:
            self.say(f"detached; the job runs on (pid {proc.pid}): `oomguard attach {proc.pid}`")
        return EXIT_DETACHED


def _readable(fd: int) -> bool:
    return wait_readable(fd, None)


def _forward(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
