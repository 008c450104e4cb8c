"""The standby: a small process that guards the daemon's v1 cgroups while no daemon runs.

A daemon that is killed (SIGKILL, a crash the interpreter does not survive) takes its usage
thresholds with it; oom_kill_disable stays set, so a job reaching the limit by a page fault
waits for the next start, but a charge made inside a system call there (the page cache of a
write(2), kernel memory) fails with ENOMEM: a job that writes a file was lost in the second or
two before the next daemon was armed (in the soak drill, about one restart in ten).

So the daemon starts a standby (`python -m oomguard.daemon.standby`, in a session of its own)
and tells it on its stdin, one JSON line at a time, which cgroups it guards and at which level
(`{"guard": PATH, "level": BYTES, ...}`, `{"drop": PATH}`). While the daemon lives the standby
only listens. At the end of its stdin without a `{"bye": true}` (the daemon is gone) it reads
every cgroup every POLL_S, and stops every process of a cgroup whose resident memory has
reached the level (or that waits at its limit): recorded in the frozen ledger first, as the
daemon's bystanders are. The next daemon, once its own guards are armed, relieves it (SIGTERM,
found through <store>/.standby.json) before it continues what was left stopped and looks at
every cgroup. Without a new daemon within the guards' park_deadline, the standby continues
what it stopped, puts back the settings oomguard had replaced (oom_kill_disable), and ends:
the kernel handles those cgroups as it would without oomguard.

Only v1 guards that park (oom_kill_disable): v2's memory.high stays set without a daemon and
throttles growth at the threshold. The standby dies with the daemon where a service manager
kills the whole service (systemd's KillMode=mixed kills what is left once the main process has
died): there the gap from the crash to the next start's guards remains (README, "Across a
restart")."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from oomguard.model.atomicfile import write_atomically
from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import ProcReader
from oomguard.store.names import FROZEN_LEDGER, SAVED_HIGH, STANDBY_RECORD

RELIEVE_WAIT = 2.0  # the next daemon waits this long for the old standby to end
POLL_S = 0.005  # while no daemon runs: every cgroup is read this often (usage first)


# -- the daemon's side -----------------------------------------------------------------------

class Standby:
    """Started by the daemon at start, told of each guard as it is armed or let go, and told
    goodbye when the daemon stops cleanly (then it ends without doing anything)."""

    def __init__(self, store: Path, log: Any, proc: ProcReader | None = None) -> None:
        self.store = store
        self.log = log
        self.proc = proc or ProcReader()
        self.handle: subprocess.Popen[bytes] | None = None
        self.told: dict[str, dict[str, Any]] = {}
        self.ready = False  # take_over() has run: the previous standby is gone
        self.failed = False

    def relieve_previous(self) -> int | None:
        """End the standby a dead daemon left (its pid and start time in the store's record),
        waiting until it is gone: what it stopped is then the next start's to continue.
        Returns its pid, or None where there was none."""
        try:
            record = json.loads((self.store / STANDBY_RECORD).read_text())
            pid, start = int(record["pid"]), int(record["start"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if pid <= 1 or start <= 0 or not self._alive(pid, start):
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + RELIEVE_WAIT
        while time.monotonic() < deadline and self._alive(pid, start):
            time.sleep(0.005)
        return pid

    def _alive(self, pid: int, start: int) -> bool:
        """The same process, not yet dead (a zombie has ended: its parent reaps it)."""
        try:
            return self.proc.starttime(pid) == start and self.proc.state(pid) not in ("Z", "X")
        except ProcessGone:
            return False

    def take_over(self) -> int | None:
        """At start, once the daemon's guards are armed: end the previous daemon's standby
        (relieve_previous); from now on this daemon's runs, started with the first cgroup it
        is told of. Returns the previous standby's pid, if there was one."""
        previous = self.relieve_previous()
        self.ready = True
        if self.told:
            self._start()
        return previous

    def _start(self) -> None:
        """Start this daemon's standby, recorded in the store (where the next start finds it),
        and tell it every cgroup told so far. Without it the daemon guards as before, and
        says once that the gap stays."""
        if self.handle is not None or self.failed:
            return
        try:
            self.store.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.handle = subprocess.Popen(
                [sys.executable, "-I", "-m", "oomguard.daemon.standby", "--ledger",
                 str(self.store / FROZEN_LEDGER), "--saved",
                 str(self.store / SAVED_HIGH)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
                start_new_session=True)
            # Recorded, or not kept: one the next start cannot find would guard on its own.
            record = {"pid": self.handle.pid, "start": self.proc.starttime(self.handle.pid)}
            # Not fsync'd: it names a process a machine's crash takes with it, and a start
            # under memory pressure must not wait on the disk.
            write_atomically(self.store / STANDBY_RECORD, json.dumps(record), 0o644, sync=False)
        except OSError as exc:
            self.bye()
            self.failed = True
            self.log.warning("standby.unavailable", error=str(exc),
                             explanation="while no daemon runs (between a crash and the next "
                             "start) nothing stops a job at its threshold")
            return
        for message in self.told.values():
            self._send(message)

    def tell(self, path: str, level: int, mount: str, deadline: float) -> None:
        """A cgroup to stop at `level` bytes of resident memory while no daemon runs."""
        message = {"guard": path, "level": level, "mount": mount, "deadline": deadline}
        if self.told.get(path) == message:
            return
        self.told[path] = message
        if self.ready and self.handle is None:
            self._start()  # sends every cgroup told
        else:
            self._send(message)

    def forget(self, path: str) -> None:
        if self.told.pop(path, None) is not None:
            self._send({"drop": path})

    def bye(self) -> None:
        """The daemon stops cleanly (it puts back what it changed): the standby just ends."""
        if self.handle is None:
            return
        self._send({"bye": True})
        with contextlib.suppress(OSError):
            assert self.handle.stdin is not None
            self.handle.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.handle.wait(timeout=5)
        with contextlib.suppress(OSError):
            (self.store / STANDBY_RECORD).unlink()
        self.handle = None

    def _send(self, message: dict[str, Any]) -> None:
        if self.handle is None or self.handle.stdin is None:
            return
        try:
            self.handle.stdin.write(json.dumps(message).encode() + b"\n")
            self.handle.stdin.flush()
        except OSError as exc:  # it died: said once, and the daemon goes on without it
            self.log.warning("standby.lost", error=str(exc), pid=self.handle.pid)
            self.handle = None


# -- the standby's side ----------------------------------------------------------------------

@dataclass
class Watched:
    path: Path
    level: int  # bytes of resident memory at which its processes are stopped
    mount: Path
    deadline: float  # seconds: how long they may stay stopped without a daemon


def listen(stream: IO[bytes]) -> dict[str, Watched] | None:
    """What the daemon says, until its end: the guarded cgroups when it went away without a
    goodbye (it died), None after a goodbye."""
    watched: dict[str, Watched] = {}
    for line in stream:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if not isinstance(message, dict):
            continue
        if message.get("bye"):
            return None
        if "drop" in message:
            watched.pop(str(message["drop"]), None)
        elif "guard" in message:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                watched[str(message["guard"])] = Watched(
                    Path(message["guard"]), int(message["level"]), Path(message["mount"]),
                    float(message["deadline"]))
    return watched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oomguard.daemon.standby")
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--saved", type=Path, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the daemon's
    from oomguard.daemon.standbyguard import JsonLog, StandbyGuard  # now, not when needed

    guard = StandbyGuard(args.ledger, args.saved, JsonLog())
    watched = listen(sys.stdin.buffer)
    if watched is None or not watched:
        return 0
    return guard.run(list(watched.values()))


if __name__ == "__main__":
    sys.exit(main())
