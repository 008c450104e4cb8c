"""The terminal of a job restored after it was typed at a shell prompt: a new pty, held by a
holder that also leads the job's session and reaps it.

Such a job's terminal belonged to the user's shell's session, outside the dumped tree; CRIU
(--shell-job) restores it only onto the terminal of the session CRIU runs in, taken from its
standard input. So the restorer runs CRIU through this program
(`python -I -m oomguard.terminal.leader --master-fd M --slave-fd S --listen-fd L --uid U
--gid G --pidfile P -- CRIU RESTORE ...`):

- the process the runner started waits for CRIU's exit status and exits with it;
- its child, the leader, starts a session of its own with the new pty as its controlling
  terminal, becomes a child subreaper and runs CRIU with the pty on its standard input. CRIU
  puts the restored tree into this session, on this terminal (its termios from the images),
  and when CRIU exits the tree's root is reparented to the leader, which waits for it;
- once CRIU has succeeded, the leader takes the terminal's foreground, continues the restored
  tree (restored stopped; the tasks the user had stopped stay so), drops to the job's user
  and serves the pty as its holder (oomguard/terminal/holder.py): the job gets the foreground when it reads or
  sets the terminal (SIGTTIN/SIGTTOU stop it, the leader hands it the terminal and continues
  it), as a shell's job does; the leader knows when the job stops, goes on or ends, and with
  what status.

Should the runner kill the first process (CRIU's timeout), the leader and CRIU die with it
(PR_SET_PDEATHSIG). Stdlib and oomguard.terminal only.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import sys
import termios

from oomguard.model.wakepipe import WakePipe
from oomguard.terminal.holder import Holder
from oomguard.terminal.holderprocess import detach_stdio, parse_options, serve
from oomguard.terminal.jobprocs import descendants, ns_pid

KEEP_STOPPED_ENV = "OOMGUARD_KEEP_STOPPED"  # act/criu.py's: CRIU's environment, ours too

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
EXIT_LEADER_DIED = 1
STOPS_FOR_TERMINAL = (signal.SIGTTIN, signal.SIGTTOU)


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Reaper:
    """The leader's side of the holder: its children's stops, continues and exits."""

    def __init__(self, master: int, root: int) -> None:
        self.master = master
        self.root = root
        try:
            self.pgrp: int | None = os.getpgid(root)
        except OSError:
            self.pgrp = None
        self.status: int | None = None
        self.signal: int | None = None
        self.children = True
        self.wakeups = WakePipe()  # SIGCHLD's
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wakeups.write_fd, warn_on_full_buffer=False)

    def wake_fd(self) -> int:
        return self.wakeups.fileno()

    def job_pgrp(self) -> int | None:
        return self.pgrp if self.children else None

    def alive(self) -> bool:
        return self.children

    def outcome(self) -> tuple[int | None, int | None]:
        return self.status, self.signal

    def give_terminal(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            pgrp = os.getpgid(pid)
            os.tcsetpgrp(self.master, pgrp)
            os.killpg(pgrp, signal.SIGCONT)

    def reap(self, holder: Holder) -> None:
        while self.wakeups.drain():
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:
                self.children = False
                return
            if pid == 0:
                return
            if os.WIFSTOPPED(status):
                if os.WSTOPSIG(status) in STOPS_FOR_TERMINAL:
                    self.give_terminal(pid)  # it wants the terminal: as a shell's `fg`
                    holder.observe()
                elif os.WSTOPSIG(status) == signal.SIGTSTP:
                    holder.observe(stop_told=True)
            elif os.WIFCONTINUED(status):
                holder.observe(stop_told=True)
            elif pid == self.root:
                if os.WIFSIGNALED(status):
                    self.signal = os.WTERMSIG(status)
                else:
                    self.status = os.WEXITSTATUS(status)


def keep_stopped(text: str) -> set[int]:
    """The restorer's list of tasks the user had stopped (namespace pids, comma-separated)."""
    return {int(part) for part in text.split(",") if part.strip().isdigit()}


def continue_job(root: int, keep_ns: set[int]) -> None:
    """Continue the restored tree (dumped stopped, so restored stopped), but the tasks the user
    had stopped, now that we have the terminal's foreground: the restorer continues it too,
    but a restorer killed halfway would have left it stopped. Its process group is not
    orphaned (we are its parent, in the session), so a task left stopped stays so."""
    for pid in [root, *descendants(root)]:
        if keep_ns and ns_pid(pid) in keep_ns:
            continue
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


def drop_to(uid: int, gid: int) -> None:
    if uid == os.getuid() and gid == os.getgid():
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def run_restorer(command: list[str], slave: int, keep: set[int]) -> int:
    """CRIU as our child, the pty on its standard input, in a process group of its own (a
    restored root that led no group of its own joins CRIU's: not ours); its exit status."""
    child = os.fork()
    if child == 0:
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            os.setpgid(0, 0)
            os.dup2(slave, 0)
            for fd in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
            signal.signal(signal.SIGTTOU, signal.SIG_DFL)
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"leader: {command[0]}: {exc.strerror}\n".encode())
        os._exit(127)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def lead(opts: dict[str, str], origin: list[str], command: list[str], report: int) -> int:
    """The leader: runs CRIU in its session, then holds the terminal until the job is over."""
    master, slave = int(opts["--master-fd"]), int(opts["--slave-fd"])
    listen = int(opts["--listen-fd"])
    parent = os.getppid()
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return EXIT_LEADER_DIED  # the runner killed the waiter already
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we set the foreground from the background
    code = run_restorer(command, slave, {master, listen, report})
    os.close(slave)
    detach_stdio()
    prctl(PR_SET_PDEATHSIG, 0)
    if code != 0:
        os.write(report, f"{code}\n".encode())
        return 0
    try:
        with open(opts["--pidfile"]) as f:
            root = int(f.read().strip())
        os.tcsetpgrp(master, os.getpgrp())  # the job gets the terminal when it asks for it
        continue_job(root, keep_stopped(os.environ.get(KEEP_STOPPED_ENV, "")))
        drop_to(int(opts["--uid"]), int(opts["--gid"]))
    except (OSError, ValueError) as exc:
        os.write(report, f"{EXIT_LEADER_DIED}\n{exc}\n".encode())
        return 0
    os.write(report, b"0\n")
    os.close(report)
    listener = socket.socket(fileno=listen)
    reaper = Reaper(master, root)
    holder = Holder(master, listener, float(opts.get("--grace", "30")), None, origin,
                    leader=reaper)
    reaper.reap(holder)  # a stop or an exit before we listened for SIGCHLD
    holder.observe()
    serve(holder, listener)
    return 0


def main(argv: list[str]) -> int:
    opts, origin, command = parse_options(argv)
    if not command:
        return 2
    rfd, wfd = os.pipe()
    if os.fork() == 0:
        os.close(rfd)
        os._exit(lead(opts, origin, command, wfd))
    os.close(wfd)
    for name in ("--master-fd", "--slave-fd", "--listen-fd"):
        with contextlib.suppress(OSError, KeyError, ValueError):
            os.close(int(opts[name]))
    answer = b""
    while chunk := os.read(rfd, 4096):
        answer += chunk
    first = answer.split(b"\n", 1)[0]
    if not first.isdigit():
        return EXIT_LEADER_DIED
    if len(answer.split(b"\n", 1)) > 1 and answer.split(b"\n", 1)[1].strip():
        os.write(2, b"leader: " + answer.split(b"\n", 1)[1])
    return int(first)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
