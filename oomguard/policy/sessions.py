"""Session processes: what holds a person's session rather than a job. An interactive shell, a
terminal multiplexer, an ssh session, a desktop or login session's leader: a checkpoint or a
kill of one ends the terminal, the connection or the desktop with it, where the job it runs is
what grew. They bound victim trees (oomguard.policy.victims): never a member, their children
root trees of their own. Pure functions of what /proc says; no I/O.

A job keeps its own processes: `make` typed at a prompt is the tree of make and its compilers,
`bash build.sh` and `sh -c CMD` are jobs (a shell with a script or a command), and a session
started by `oomguard exec` (inside its own PID namespace) is dumped whole from its init."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.sense.procfs import ProcessInfo

SHELL = "an interactive shell"
MULTIPLEXER = "a terminal multiplexer"
SSH = "an ssh session"
DESKTOP = "a desktop or login session's leader"

SHELLS = frozenset({
    "sh", "bash", "rbash", "dash", "ash", "zsh", "ksh", "ksh93", "mksh", "lksh", "pdksh", "oksh",
    "yash", "posh", "fish", "tcsh", "csh", "nu", "elvish", "pwsh",
})
# Short options that take the next word as their argument, by shell (a `-o vi` is not a
# script operand). Others: none (`-c`'s command string is an operand: see _invocation).
OPTION_ARGS = {"bash": "oO", "rbash": "oO", "fish": "Cdop"}
OPTION_ARGS_DEFAULT = "o"
LONG_OPTION_ARGS = frozenset({"rcfile", "init-file", "init-command", "debug", "debug-output",
                              "profile", "profile-startup", "features", "option"})

MULTIPLEXERS = frozenset({"tmux", "screen", "zellij", "dtach", "abduco", "mosh-server"})
SSHDS = frozenset({"sshd", "sshd-session", "sshd-auth", "dropbear"})
DESKTOPS = frozenset({
    "login", "xinit", "startx", "x", "xorg", "xwayland", "gdm", "gdm3", "gdm-session-worker",
    "gdm-wayland-session", "gdm-x-session", "lightdm", "sddm", "sddm-helper", "(sd-pam)",
    "ksmserver", "plasma_session", "kwin_wayland", "kwin_x11", "gnome-shell", "sway", "hyprland",
    "river", "labwc", "wayfire", "weston", "niri", "lxsession",
})
# ...and every name ending so: gnome-session(-binary), xfce4-session, startplasma-wayland...
DESKTOP_SUFFIXES = ("-session", "-session-binary")
DESKTOP_PREFIXES = ("startplasma-", "gnome-session")


@dataclass(frozen=True)
class ShellInvocation:
    interactive: bool  # -i / --interactive
    runs_command: bool  # -c / --command, or a script operand (not after -s: arguments)


def names(proc: ProcessInfo) -> set[str]:
    """The names a process goes by, lower-cased: its comm (up to "tmux: server"'s colon) and
    its argv[0]'s base name without a login shell's leading '-'."""
    found = {proc.comm.split(":", 1)[0].strip().lower()}
    if proc.cmdline:
        argv0 = proc.cmdline[0].split()[0] if proc.cmdline[0].strip() else ""
        base = argv0.rsplit("/", 1)[-1].lstrip("-").rstrip(":").lower()
        if base:
            found.add(base)
    found.discard("")
    return found


def shell_invocation(shell: str, args: tuple[str, ...]) -> ShellInvocation:
    """How a shell was started, from its arguments (after argv[0]): options up to the first
    operand (`--` or `-` ends them), which is a script, or the command string after -c
    (after -s, the operands are arguments and the commands come from standard input)."""
    takes_arg = OPTION_ARGS.get(shell, OPTION_ARGS_DEFAULT)
    interactive = command = from_stdin = False
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in ("--", "-"):
            index += 1
            break
        if arg.startswith("--"):
            name, has_value, _ = arg[2:].partition("=")
            interactive |= name == "interactive"
            command |= name == "command"
            index += 2 if name in LONG_OPTION_ARGS and not has_value else 1
            continue
        if len(arg) > 1 and arg[0] in "-+":
            letters = arg[1:]
            if arg[0] == "-":
                interactive |= "i" in letters
                command |= "c" in letters
                from_stdin |= "s" in letters
            index += 2 if any(letter in takes_arg for letter in letters) else 1
            continue
        break
    return ShellInvocation(interactive, command or (index < len(args) and not from_stdin))


def is_interactive_shell(proc: ProcessInfo) -> bool:
    """A shell a person types into: a login shell (argv[0] starts with '-'), one started with
    -i, or one with neither a script nor -c that has a controlling terminal. `bash job.sh`,
    `sh -c CMD` and a shell without a terminal (a systemd or Slurm job's) are jobs."""
    shells = names(proc) & SHELLS
    if not shells:
        return False
    if proc.cmdline and proc.cmdline[0].startswith("-"):
        return True
    how = shell_invocation(min(shells), proc.cmdline[1:])
    if how.interactive:
        return True
    return not how.runs_command and proc.tty_nr != 0


def _is_desktop(proc: ProcessInfo, found: set[str]) -> bool:
    if found & DESKTOPS:
        return True
    if any(n.endswith(DESKTOP_SUFFIXES) or n.startswith(DESKTOP_PREFIXES) for n in found):
        return True
    # A user's service manager (`systemd --user`); PID 1 is protected anyway.
    return "systemd" in found and "--user" in proc.cmdline[1:]


def session_role(proc: ProcessInfo) -> str | None:
    """What session `proc` holds (SHELL, MULTIPLEXER, SSH, DESKTOP), None for a job's process.
    Inside a nested PID namespace nothing is: such a namespace (`oomguard exec`) is dumped
    whole from its init, which CRIU needs."""
    if len(proc.nspid) > 1:
        return None
    found = names(proc)
    if found & MULTIPLEXERS:
        return MULTIPLEXER
    if found & SSHDS:
        return SSH
    if _is_desktop(proc, found):
        return DESKTOP
    if is_interactive_shell(proc):
        return SHELL
    return None
