"""PID 1 of an `oomguard exec` namespace: starts the job, reaps every orphan, forwards signals
to the job, and exits with the job's status once all its processes are gone.

Run as a script (`python -I nsinit.py [--tty-fd N] [--cgroup-procs FILE] -- CMD ...`): stdlib
only, no oomguard import, so nothing outside the standard library is loaded into a process that
will be checkpointed. When the job has a terminal, this process is the session leader and the
terminal is its controlling terminal. The job starts in the background of it and gets the
foreground the first time it reads the terminal or sets its modes: the kernel stops it
(SIGTTIN/SIGTTOU) and this init hands it the terminal and continues it. Until then nobody
passes it the keys (as a shell's job that does not read leaves them), so lines typed or pasted
after `oomguard exec` stay for the user's shell.
Ctrl-Z (SIGTSTP) stops the job and it stays stopped until something continues it (`fg` of
`oomguard exec`, or an attach). Each such change is announced to the pty's holder by stopping
and restarting the terminal's output at once (its master is in packet mode: TIOCPKT_STOP and
TIOCPKT_START; no byte is lost). CRIU restores
an inherited terminal without the session's controlling-terminal link, so on every SIGCONT (a
restored tree is continued with one) this init takes the terminal back, and gives the job the
foreground again if it had it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import sys
import termios
from types import FrameType

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGWINCH, signal.SIGALRM)
EXIT_NOT_STARTED = 127
EXIT_NO_CGROUP = 125
TIOCGSID = 0x5429  # not in Python's termios


class Init:
    def __init__(self, tty_fd: int | None) -> None:
        self.tty_fd = tty_fd
        self.job: int | None = None  # the main job's pid (and process group) while it lives
        self.job_has_terminal = False  # it read the terminal (or set it) once: foreground
        self.status = 0

    def announce(self) -> None:
        """Tell the pty's holder the job's state changed: output suspended and resumed at
        once (tcflow), which its master, in packet mode, reports; nothing is lost."""
        if self.tty_fd is not None:
            with contextlib.suppress(OSError, termios.error):
                termios.tcflow(self.tty_fd, termios.TCOOFF)
                termios.tcflow(self.tty_fd, termios.TCOON)

    def give_terminal(self) -> None:
        """The job asked for the terminal (it was stopped reading or setting it): it gets the
        foreground and goes on."""
        if self.tty_fd is None or self.job is None:
            return
        self.job_has_terminal = True
        with contextlib.suppress(OSError):
            os.tcsetpgrp(self.tty_fd, self.job)
        with contextlib.suppress(OSError):
            os.killpg(self.job, signal.SIGCONT)

    def take_terminal(self) -> None:
        """Make the terminal ours (session leader) and the job's group its foreground, unless
        it is ours already (a SIGCONT after a freeze that was not a restore: the job may have
        put another group of its own in the foreground)."""
        if self.tty_fd is None:
            return
        with contextlib.suppress(OSError):
            sid = struct.unpack("i", fcntl.ioctl(self.tty_fd, TIOCGSID, b"\0" * 4))[0]
            if sid == os.getsid(0):
                return
        with contextlib.suppress(OSError):
            fcntl.ioctl(self.tty_fd, termios.TIOCSCTTY, 0)
        if self.job is not None and self.job_has_terminal:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(self.tty_fd, self.job)
        self.announce()

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            if self.job is not None:
                os.killpg(self.job, signum)
            else:
                os.kill(-1, signum)  # the job is gone: what it left behind (a daemon) gets it

    def on_cont(self, _signum: int, _frame: FrameType | None) -> None:
        self.take_terminal()

    def start(self, argv: list[str]) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)  # a group of its own, in the background until it reads
                if self.tty_fd is not None and self.tty_fd > 2:
                    os.close(self.tty_fd)
                for sig in (*FORWARDED, signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP,
                            signal.SIGCONT, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                os.execvp(argv[0], argv)
            except OSError as exc:
                os.write(2, f"{argv[0]}: {exc.strerror}\n".encode())
            os._exit(EXIT_NOT_STARTED)
        self.job = pid

    def job_stopped(self, sig: int) -> None:
        """SIGTTIN/SIGTTOU: it wants the terminal; SIGTSTP: Ctrl-Z, it stays stopped until
        continued (`fg`), and the holder is told. (A freeze for a checkpoint is a SIGSTOP, and
        is left alone: nothing is announced.)"""
        if sig in (signal.SIGTTIN, signal.SIGTTOU):
            self.give_terminal()
            self.announce()
        elif sig == signal.SIGTSTP:
            self.announce()

    def reap(self) -> int:
        """Wait for every process of the namespace; the job's own status is the answer."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:
                return self.status
            if os.WIFSTOPPED(wait_status):
                if pid == self.job:
                    self.job_stopped(os.WSTOPSIG(wait_status))
                continue
            if os.WIFCONTINUED(wait_status):
                if pid == self.job:
                    self.announce()
                continue
            if pid == self.job:
                self.job = None
                code = os.waitstatus_to_exitcode(wait_status)
                self.status = code if code >= 0 else 128 - code


def parse_args(argv: list[str]) -> tuple[int | None, str | None, list[str]]:
    tty_fd: int | None = None
    procs: str | None = None
    rest = list(argv)
    while rest and rest[0] != "--":
        option = rest.pop(0)
        if option == "--tty-fd":
            tty_fd = int(rest.pop(0))
        elif option == "--cgroup-procs":
            procs = rest.pop(0)
        else:
            raise SystemExit(f"nsinit: unknown option {option}")
    return tty_fd, procs, rest[1:]


def main(argv: list[str]) -> int:
    tty_fd, procs, command = parse_args(argv)
    if not command:
        return 2
    if procs is not None:
        try:
            with open(procs, "w") as f:
                f.write("0")  # "0" is the writer itself, whatever its PID namespace
        except OSError:
            return EXIT_NO_CGROUP  # oomguard exec says so (not on the job's streams)
    init = Init(tty_fd)
    for sig in (signal.SIGTTOU, signal.SIGTTIN, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    init.take_terminal()
    for sig in (*FORWARDED, signal.SIGTSTP):
        signal.signal(sig, init.forward)
    signal.signal(signal.SIGCONT, init.on_cont)
    init.start(command)
    return init.reap()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
