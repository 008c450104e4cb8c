"""A real terminal for tests: tmux on a private server, its panes running an interactive bash
at a prompt (or a program of the test's), driven as a person does: keys typed, blocks pasted,
the screen read back. The one terminal helper of the suite."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.helpers import EMULATION_FACTOR, wait_until

PROMPT = "og$ "
VENV_BIN = str(Path(sys.executable).parent)
Needle = str | re.Pattern[str]


class TmuxServer:
    """A tmux server of the test's own (`tmux -L NAME`, no config), as `user` when given (tmux,
    and so the shells in it, run as that uid)."""

    def __init__(self, name: str, env: dict[str, str] | None = None,
                 user: int | None = None) -> None:
        self.as_user = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}",
                                                "--clear-groups", "--"]
        self.name = f"og-{name}-{os.getpid()}-{time.monotonic_ns() % 100000}"
        base = env if env is not None else os.environ
        environ = {**base, "TERM": "xterm", "HISTFILE": "/dev/null",
                   "PATH": f"{VENV_BIN}:{base.get('PATH', '/usr/bin:/bin')}"}
        for name_ in ("TMUX", "COLUMNS", "LINES"):
            environ.pop(name_, None)
        self.env = environ
        self.rcfile = Path(tempfile.mkstemp(prefix="og-bashrc-")[1])
        self.rcfile.write_text(f"PS1='{PROMPT}'\nexport PATH='{environ['PATH']}'\n")
        self.rcfile.chmod(0o644)

    def shell_command(self) -> str:
        return f"bash --noprofile --rcfile {self.rcfile} -i"

    def tmux(self, *args: str) -> str:
        result = subprocess.run([*self.as_user, "tmux", "-L", self.name, "-f", "/dev/null",
                                 *args], capture_output=True, text=True, env=self.env,
                                timeout=30, stdin=subprocess.DEVNULL)
        if result.returncode != 0 and args[0] != "kill-server":
            raise AssertionError(f"tmux {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def close(self) -> None:
        self.tmux("kill-server")
        self.rcfile.unlink(missing_ok=True)


class TmuxPane:
    """One pane: what is typed into it and what it shows."""

    def __init__(self, server: TmuxServer, target: str, shell: bool = True) -> None:
        self.server = server
        self.target = target
        if shell:
            self.wait_prompt(1)

    def tmux(self, *args: str) -> str:
        return self.server.tmux(*args)

    def type(self, text: str, enter: bool = True) -> None:
        """Typed, as keys (literally), then Enter."""
        if text:
            self.tmux("send-keys", "-t", self.target, "-l", text)
        if enter:
            self.tmux("send-keys", "-t", self.target, "Enter")

    def keys(self, *keys: str) -> None:
        """tmux key names: C-z, C-c, C-\\\\, Enter."""
        self.tmux("send-keys", "-t", self.target, *keys)

    def paste(self, block: str) -> None:
        """A block pasted into the terminal at once (no bracketed paste: the shell reads it
        line by line as it would keys typed ahead; each line ends with Enter)."""
        with tempfile.NamedTemporaryFile("w", suffix=".paste", delete=False) as f:
            f.write(block if block.endswith("\n") else block + "\n")
        try:
            os.chmod(f.name, 0o644)
            self.tmux("load-buffer", "-b", "og", f.name)
            self.tmux("paste-buffer", "-b", "og", "-t", self.target)
        finally:
            os.unlink(f.name)

    def screen(self) -> str:
        """Everything the pane has shown (its history too), wrapped lines joined."""
        text = self.tmux("capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", self.target)
        return text.rstrip("\n") + "\n"  # not the empty rows below the cursor

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen().splitlines()]

    def mark(self) -> int:
        """Where the screen's last line (the prompt being typed at) begins: wait_for(...,
        since=mark) looks from there on."""
        text = self.screen().rstrip("\n")
        return text.rfind("\n") + 1

    def wait_for(self, needle: Needle, timeout: float = 30, since: int = 0) -> str:
        """Until `needle` (text, or a pattern: re.M for ^ and $ per line) is on the screen
        (after `since`); returns the screen from `since`."""
        def seen() -> str | None:
            text = self.screen()[since:]
            found = needle.search(text) if isinstance(needle, re.Pattern) else needle in text
            return text if found else None

        text = wait_until(seen, timeout * EMULATION_FACTOR, interval=0.1)
        if not text:
            raise AssertionError(f"{needle!r} never appeared on the terminal:\n"
                                 f"{self.screen()[-3000:]}")
        return str(text)

    def prompts(self) -> int:
        return sum(1 for line in self.screen().splitlines() if line.startswith(PROMPT))

    def wait_prompt(self, count: int, timeout: float = 30) -> None:
        """Until the screen shows `count` prompts: the shell waits for the next command."""
        if not wait_until(lambda: self.prompts() >= count, timeout * EMULATION_FACTOR, 0.1):
            raise AssertionError(f"the shell never came back ({count} prompts):\n"
                                 f"{self.screen()[-3000:]}")

    def run(self, command: str, timeout: float = 60) -> str:
        """Type a command and wait for the next prompt; returns the screen from the command's
        line on (the command, its output, the next prompt)."""
        before, since = self.prompts(), self.mark()
        self.type(command)
        self.wait_prompt(before + 1, timeout)
        return self.screen()[since:]

    def output(self, command: str, timeout: float = 60) -> list[str]:
        """Type a command at the prompt; the lines it printed, up to the next prompt."""
        lines = self.run(command, timeout).rstrip("\n").splitlines()
        return [line.rstrip() for line in lines[1:] if not line.startswith(PROMPT.rstrip())]

    def pane_pid(self) -> int:
        return int(self.tmux("display-message", "-p", "-t", self.target, "#{pane_pid}"))

    def tty(self) -> str:
        return self.tmux("display-message", "-p", "-t", self.target, "#{pane_tty}").strip()


class TmuxShell(TmuxPane):
    """A terminal window: a tmux server with one pane, running `bash -i` at a plain prompt
    (`og$ `, no rc files but PATH with this checkout's oomguard first), or `command`."""

    def __init__(self, name: str, cwd: Path, env: dict[str, str] | None = None,
                 width: int = 200, height: int = 50, user: int | None = None,
                 command: str | None = None) -> None:
        server = TmuxServer(name, env, user)
        self.cwd = cwd
        server.tmux("new-session", "-d", "-s", server.name, "-x", str(width), "-y",
                    str(height), "-c", str(cwd), command or server.shell_command())
        server.tmux("set-option", "-t", server.name, "history-limit", "20000")
        super().__init__(server, f"{server.name}:0.0", shell=command is None)

    def split(self, command: str | None = None) -> TmuxPane:
        """Another pane in the same window (a second shell, or `command`)."""
        pane = self.tmux("split-window", "-v", "-d", "-P", "-F", "#{pane_id}", "-t",
                         self.target, "-c", str(self.cwd),
                         command or self.server.shell_command()).strip()
        return TmuxPane(self.server, pane, shell=command is None)

    def close(self) -> None:
        self.server.close()


@contextlib.contextmanager
def tmux_shell(name: str, cwd: Path, env: dict[str, str] | None = None,
               user: int | None = None, command: str | None = None,
               width: int = 200) -> Iterator[TmuxShell]:
    shell = TmuxShell(name, cwd, env, width=width, user=user, command=command)
    try:
        yield shell
    finally:
        shell.close()


def wait_gone(pid: int, timeout: float = 30) -> bool:
    return bool(wait_until(lambda: not Path(f"/proc/{pid}").exists()
                           or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX",
                           timeout))


def pids_running(pattern: str) -> list[int]:
    """Processes whose command line holds `pattern` (as a person finds them with ps)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            if pattern.encode() in cmdline:
                found.append(int(entry))
    return sorted(found)


def state_of(pid: int) -> str | None:
    """A process's state letter, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[0]


def stop_and_continue(pane: TmuxPane, pid: int, progress: Callable[[], int]) -> int:
    """Ctrl-Z in `pane`, whose shell's foreground job shows the job `pid`: the shell says
    Stopped and gives its prompt back, the job is stopped and makes no progress while the
    shell runs a command; `fg` brings it back and it goes on. Returns where it stopped."""
    prompts = pane.prompts()
    pane.keys("C-z")
    pane.wait_for("Stopped")
    pane.wait_prompt(prompts + 1)
    assert wait_until(lambda: state_of(pid) == "T", 10), "Ctrl-Z did not stop the job"
    stopped_at = progress()
    pane.run("sleep 0.5")  # a while in which nothing may happen
    assert progress() == stopped_at, "the job went on while stopped"
    pane.type("fg")
    assert wait_until(lambda: progress() >= stopped_at + 3, 30 * EMULATION_FACTOR), \
        "fg did not continue the job"
    return stopped_at
