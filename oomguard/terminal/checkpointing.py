"""The terminals of a tree being checkpointed, from the freeze to the commit: which CRIU is
told about (external ones: a pty whose master is held outside the tree, as `oomguard exec`'s
holder; the shell's terminal of a job typed at a prompt), what meta.json records of them, and
who is told what: the holders (a dump is under way, it is done: keep the terminal; it failed),
and a person at the shell prompt the job was typed at (a line saying how to bring it back).
A holder's socket is the job's user's to choose: each is given NOTIFY_DEADLINE to answer, all
at once, and the checkpointer tells them nothing while the cgroup's limit is lifted but that a
dump is under way (from a thread, while the dump is prepared, before CRIU starts)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.terminal.client import NOTIFY_DEADLINE, SYSTEM_DIR, notify_all, trusted_socket
from oomguard.terminal.external import TTYS, ExternalTty, dump_args, external_ttys
from oomguard.terminal.shelljob import (
    SHELL_TTY,
    ShellTty,
    holder_serving,
    read_tasks,
    refusal,
    shell_tty_of,
    tell_terminal,
)


def terminal_refusal(proc_root: Path | str, pids: Iterable[int]) -> str | None:
    """Before anything is stopped: why CRIU could not restore the tree's terminals, if so."""
    return refusal(read_tasks(proc_root, pids))


@dataclass
class DumpTerminals:
    uid: int
    external: list[ExternalTty] = field(default_factory=list)
    shell: ShellTty | None = None
    told: list[str] = field(default_factory=list)  # holders told a dump is under way
    telling: threading.Thread | None = field(default=None, repr=False, compare=False)
    told_in: float = 0.0  # seconds the dump waited for the holders to answer `dumping`

    @staticmethod
    def of(proc_root: Path | str, pids: list[int], uid: int,
           system_dir: Path = SYSTEM_DIR) -> DumpTerminals:
        """Read once the tree has stopped (what CRIU will find)."""
        shell = shell_tty_of(read_tasks(proc_root, pids))
        if shell is not None:
            shell = ShellTty(shell.rdev, shell.dev, shell.index,
                             holder_serving(shell.key, system_dir / str(uid)))
        return DumpTerminals(uid, external_ttys(proc_root, pids), shell)

    def dump_args(self) -> list[str]:
        return dump_args(self.external)

    def record(self, extra: dict[str, Any]) -> None:
        if self.external:
            extra[TTYS] = [tty.as_dict() for tty in self.external]
        if self.shell is not None:
            extra[SHELL_TTY] = self.shell.as_dict()

    def holders(self) -> list[str]:
        sockets = {tty.socket for tty in self.external if tty.socket}
        if self.shell is not None and self.shell.socket:
            sockets.add(self.shell.socket)
        return sorted(s for s in sockets if trusted_socket(s, self.uid))

    def start_dumping(self, checkpoint_id: str) -> None:
        """A dump is under way: a holder whose job vanishes now keeps the terminal for the
        pin (its grace) instead of ending as after an exit. Told from a thread, while the
        dump is prepared; `dumping_told` waits for it (NOTIFY_DEADLINE at most)."""
        holders = self.holders()
        if not holders:
            return

        def tell() -> None:
            self.told = notify_all(holders, "dumping", id=checkpoint_id)

        self.telling = threading.Thread(target=tell, name="oomguard-tell-holders", daemon=True)
        self.telling.start()

    def dumping_told(self) -> None:
        """Before CRIU starts: the holders have answered `dumping`, or their time is up."""
        if self.telling is not None:
            start = time.monotonic()
            self.telling.join(NOTIFY_DEADLINE + 0.2)
            self.told_in = time.monotonic() - start
            self.telling = None

    def dumping(self, checkpoint_id: str) -> None:
        self.start_dumping(checkpoint_id)
        self.dumping_told()

    def failed(self) -> None:
        """The dump failed: the job runs on (thawed) on its terminal."""
        self.dumping_told()
        notify_all(list(self.told), "unpin", restored=False)
        self.told = []

    def committed(self, checkpoint_id: str, command: str, pid: int) -> None:
        """The checkpoint is on disk: the holders keep the terminal for the restore; a
        person at the shell prompt the job was typed at reads how to bring it back."""
        self.dumping_told()
        notify_all(self.holders(), "pin", id=checkpoint_id)
        self.told = []
        if self.shell is not None and not self.shell.socket:
            with contextlib.suppress(OSError):
                tell_terminal(self.shell, f"oomguard: `{command}` (pid {pid}) was checkpointed "
                                          f"as {checkpoint_id} to free memory; `oomguard restore "
                                          f"{checkpoint_id}` brings it back on a new terminal")
