"""A real terminal for tests: tmux on a private server, running an interactive bash at a
prompt, driven as a person does (keys typed, blocks pasted, the screen read back)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import EMULATION_FACTOR, wait_until

PROMPT = "og$ "
VENV_BIN = str(Path(sys.executable).parent)


class TmuxShell:
    """One tmux window with `bash -i` (no rc files: a plain prompt `og$ `), oomguard of this
    checkout first on PATH. Everything is typed through tmux, as keys."""

    def __init__(self, name: str, cwd: Path, env: dict[str, str] | None = None,
                 width: int = 200, height: int = 50, user: int | None = None) -> None:
        """`user`: the terminal is that user's (tmux, and so the shell, run as that uid)."""
        self.as_user = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}",
                                                "--clear-groups", "--"]
        self.server = f"og-{name}-{os.getpid()}"
        self.target = f"{self.server}:0.0"
        environ = {**(env or os.environ), "PS1": PROMPT, "TERM": "xterm",
                   "PATH": f"{VENV_BIN}:{(env or os.environ).get('PATH', '/usr/bin:/bin')}"}
        environ.pop("TMUX", None)
        self.env = environ
        self.rcfile = Path(tempfile.mkstemp(prefix="og-bashrc-")[1])
        self.rcfile.write_text(f"PS1='{PROMPT}'\nexport PATH='{environ['PATH']}'\n")
        self.rcfile.chmod(0o644)
        self.tmux("new-session", "-d", "-s", self.server, "-x", str(width), "-y", str(height),
                  "-c", str(cwd), f"bash --noprofile --rcfile {self.rcfile} -i")
        self.tmux("set-option", "-t", self.server, "history-limit", "20000")
        self.wait_prompt(1)

    def tmux(self, *args: str) -> str:
        result = subprocess.run([*self.as_user, "tmux", "-L", self.server, *args],
                                capture_output=True, text=True, env=self.env, timeout=30)
        if result.returncode != 0 and args[0] != "kill-server":
            raise AssertionError(f"tmux {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

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
            self.tmux("load-buffer", "-b", "og", f.name)
            self.tmux("paste-buffer", "-b", "og", "-t", self.target)
        finally:
            os.unlink(f.name)

    def screen(self) -> str:
        """Everything the terminal has shown (its history too), wrapped lines joined."""
        text = self.tmux("capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", self.target)
        return text.rstrip("\n") + "\n"  # not the empty rows below the cursor

    def mark(self) -> int:
        """Where the screen's last line (the prompt being typed at) begins: wait_for(...,
        since=mark) looks from there on."""
        text = self.screen().rstrip("\n")
        return text.rfind("\n") + 1

    def wait_for(self, needle: str | re.Pattern[str], timeout: float = 30,
                 since: int = 0) -> str:
        """Wait until `needle` (text or a pattern) is on the screen (after `since`); returns
        the screen."""
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
        """Type a command and wait for the next prompt; returns what appeared after it."""
        before = self.prompts()
        marker = len(self.screen())
        self.type(command)
        self.wait_prompt(before + 1, timeout)
        return self.screen()[marker:]

    def pane_pid(self) -> int:
        return int(self.tmux("display-message", "-p", "-t", self.target, "#{pane_pid}"))

    def tty(self) -> str:
        return self.tmux("display-message", "-p", "-t", self.target, "#{pane_tty}").strip()

    def close(self) -> None:
        self.tmux("kill-server")
        self.rcfile.unlink(missing_ok=True)


@contextlib.contextmanager
def tmux_shell(name: str, cwd: Path, env: dict[str, str] | None = None,
               user: int | None = None) -> Iterator[TmuxShell]:
    shell = TmuxShell(name, cwd, env, user=user)
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


def settle(seconds: float) -> None:
    """A pause that is not a synchronisation: only where a test checks that nothing
    happens (the job stays stopped) for a while."""
    time.sleep(seconds)
