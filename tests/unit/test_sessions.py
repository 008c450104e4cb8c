"""oomguard.policy.sessions: which processes hold a person's session (an interactive shell, a
terminal multiplexer, an ssh session, a desktop session's leader) and which are a job's."""

from __future__ import annotations

import dataclasses

import pytest

from oomguard.policy.sessions import (
    DESKTOP,
    MULTIPLEXER,
    SHELL,
    SSH,
    ShellInvocation,
    session_role,
    shell_invocation,
)
from oomguard.sense.procfs import ProcessInfo
from tests.unit._support import proc_info

PTS = 34816  # /dev/pts/0 as tty_nr (major 136)


def proc(comm: str, *argv: str, tty: int = 0, nspid: tuple[int, ...] = ()) -> ProcessInfo:
    return dataclasses.replace(proc_info(500, 400, comm=comm, nspid=nspid), cmdline=argv,
                               tty_nr=tty)


@pytest.mark.parametrize(
    ("info", "role"),
    [
        # interactive shells
        (proc("bash", "-bash"), SHELL),  # a login shell, terminal or not
        (proc("bash", "bash", "--norc", "-i"), SHELL),
        (proc("bash", "bash", "--norc", tty=PTS), SHELL),  # no script, a terminal
        (proc("bash", "/bin/bash", tty=PTS), SHELL),
        (proc("zsh", "-zsh", tty=PTS), SHELL),
        (proc("zsh", "zsh", "-o", "vi", tty=PTS), SHELL),  # -o's argument is no script
        (proc("fish", "/usr/bin/fish", "-l", tty=PTS), SHELL),
        (proc("fish", "fish", "-C", "set x 1", tty=PTS), SHELL),  # an init command, then a prompt
        (proc("dash", "sh", tty=PTS), SHELL),
        (proc("tcsh", "-tcsh"), SHELL),
        (proc("bash", "bash", "-ic", "make"), SHELL),  # -i says so
        (proc("bash", "bash", "-s", "arg", tty=PTS), SHELL),  # commands from the terminal
        (proc("bash", "bash", "--rcfile", "my.rc", tty=PTS), SHELL),
        # jobs
        (proc("bash", "bash", "build.sh", tty=PTS), None),
        (proc("bash", "/bin/bash", "-e", "-o", "pipefail", "build.sh", tty=PTS), None),
        (proc("sh", "/bin/sh", "-c", "python3 train.py", tty=PTS), None),
        (proc("bash", "bash", "-lc", "make -j8", tty=PTS), None),
        (proc("fish", "fish", "--command=make", tty=PTS), None),
        (proc("bash", "bash", "--", "job.sh", tty=PTS), None),
        (proc("bash", "/bin/bash"), None),  # no terminal: a systemd or Slurm job's shell
        (proc("bash", "bash", "--norc"), None),
        (proc("python3", "python3", "-i", tty=PTS), None),  # a REPL is a job
        (proc("make", "make", "-j8", tty=PTS), None),
        (proc("sleep", "sleep", "60", tty=PTS), None),
        # multiplexers, ssh, desktop and login sessions
        (proc("tmux: server", "tmux", "new", "-d"), MULTIPLEXER),
        (proc("tmux: client", "tmux", "attach", tty=PTS), MULTIPLEXER),
        (proc("screen", "SCREEN", "-S", "work"), MULTIPLEXER),
        (proc("zellij", "zellij"), MULTIPLEXER),
        (proc("dtach", "dtach", "-A", "/tmp/s", "bash"), MULTIPLEXER),
        (proc("mosh-server", "mosh-server", "new"), MULTIPLEXER),
        (proc("sshd", "sshd: alice@pts/0"), SSH),
        (proc("sshd", "sshd: alice [priv]"), SSH),
        (proc("sshd-session", "sshd-session: alice@pts/1"), SSH),
        (proc("sshd", "/usr/sbin/sshd", "-D"), SSH),
        (proc("systemd", "/lib/systemd/systemd", "--user"), DESKTOP),
        (proc("gnome-session-b", "/usr/libexec/gnome-session-binary", "--session=ubuntu"), DESKTOP),
        (proc("xfce4-session", "xfce4-session"), DESKTOP),
        (proc("startplasma-way", "/usr/bin/startplasma-wayland"), DESKTOP),
        (proc("Xorg", "/usr/lib/xorg/Xorg", ":0"), DESKTOP),
        (proc("Xwayland", "/usr/bin/Xwayland", ":1"), DESKTOP),
        (proc("login", "/bin/login", "-p", "--"), DESKTOP),
        (proc("sway", "sway"), DESKTOP),
        # not sessions
        (proc("systemd", "/lib/systemd/systemd", "--system"), None),  # a container's manager
        (proc("ssh", "ssh", "host", tty=PTS), None),  # a client: a job like any other
        (proc("python3", "python3", "/usr/bin/tmuxp-like.py"), None),
    ],
)
def test_session_role(info: ProcessInfo, role: str | None) -> None:
    assert session_role(info) == role


def test_inside_a_nested_pid_namespace_nothing_is_a_session() -> None:
    """`oomguard exec bash -i`: the namespace is dumped whole from its init."""
    assert session_role(proc("bash", "bash", "-i", tty=PTS, nspid=(500, 2))) is None
    assert session_role(proc("tmux: server", "tmux", nspid=(500, 3))) is None
    assert session_role(proc("bash", "bash", "-i", tty=PTS, nspid=(500,))) == SHELL


@pytest.mark.parametrize(
    ("shell", "args", "expected"),
    [
        ("bash", (), ShellInvocation(False, False)),
        ("bash", ("-i",), ShellInvocation(True, False)),
        ("bash", ("-c", "x"), ShellInvocation(False, True)),
        ("bash", ("-xc", "x"), ShellInvocation(False, True)),
        ("bash", ("-O", "extglob"), ShellInvocation(False, False)),
        ("bash", ("+O", "extglob", "s.sh"), ShellInvocation(False, True)),
        ("bash", ("--init-file", "f"), ShellInvocation(False, False)),
        ("bash", ("--init-file=f", "s.sh"), ShellInvocation(False, True)),
        ("bash", ("--interactive",), ShellInvocation(True, False)),
        ("bash", ("-", "s.sh"), ShellInvocation(False, True)),
        ("fish", ("-d", "proc", "x.fish"), ShellInvocation(False, True)),
        ("fish", ("-d", "proc"), ShellInvocation(False, False)),
        ("zsh", ("-s", "a", "b"), ShellInvocation(False, False)),
    ],
)
def test_shell_invocation(shell: str, args: tuple[str, ...], expected: ShellInvocation) -> None:
    assert shell_invocation(shell, args) == expected
