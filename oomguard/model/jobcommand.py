"""The command a person gave for a job: CMD of `oomguard exec -- CMD`, not the init that runs
it (`python -I .../oomguard/terminal/nsinit.py [OPTIONS] -- CMD`). Strings only: the CLI shows
it before it loads anything else."""

from __future__ import annotations

from collections.abc import Sequence

NSINIT_SCRIPT = "nsinit.py"  # oomguard/terminal/nsinit.py
NSINIT_OPTIONS = frozenset({"--tty-fd", "--cgroup-procs"})  # each takes one value


def nsinit_job_argv(cmdline: Sequence[str]) -> tuple[str, ...] | None:
    """CMD from the init's command line (`python -I .../nsinit.py [--tty-fd N]
    [--cgroup-procs FILE] -- CMD...`), None when it is not nsinit's."""
    script = next((i for i, arg in enumerate(cmdline[:8]) if arg.endswith("/" + NSINIT_SCRIPT)
                   or arg == NSINIT_SCRIPT), None)
    if script is None:
        return None
    index = script + 1
    while index < len(cmdline) and cmdline[index] in NSINIT_OPTIONS:
        index += 2
    if index >= len(cmdline) or cmdline[index] != "--" or index + 1 >= len(cmdline):
        return None
    return tuple(cmdline[index + 1:])


def job_command_from_text(command: str) -> str:
    """CMD from an init's command line as meta.json's `command` holds it (its arguments
    joined by spaces: what a checkpoint recorded before `job_command`); else `command`."""
    words = command.split(" ")
    argv = nsinit_job_argv(words)
    if argv is None:
        return command
    head = len(words) - len(argv)  # CMD's first word; the separator ' -- ' is just before it
    return " ".join(words[head:])


def job_command(recorded: str | None, command: str) -> str:
    """The command a person gave for a checkpoint's job: meta.json's `job_command`, or for a
    checkpoint taken before it was recorded, derived from `command`."""
    return recorded or job_command_from_text(command)
