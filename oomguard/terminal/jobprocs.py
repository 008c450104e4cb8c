"""A job as its terminal and /proc show it, for its pty's holder: the session leading the
terminal and its foreground process group (read off the master), a process's state, an init's
job, a job's processes, and whether one of them waits for input in select/poll/epoll.
Stdlib and the /proc sensor only (the holder imports it)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time

from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import ProcReader

TIOCGSID = 0x5429
POLL_WAITS = ("poll_schedule_timeout", "do_epoll_wait", "ep_poll", "do_select",
              "core_sys_select", "do_sys_poll")


def session_of(master: int) -> int | None:
    try:
        sid = struct.unpack("i", fcntl.ioctl(master, TIOCGSID, b"\0" * 4))[0]
    except OSError:
        return None
    return int(sid) if sid > 0 else None


def foreground_of(master: int) -> int | None:
    try:
        pgrp = os.tcgetpgrp(master)
    except OSError:
        return None
    return pgrp if pgrp > 0 else None


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[0]


def first_child_pgrp(pid: int) -> int | None:
    """The process group of `pid`'s first child: the job an init started."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        return os.getpgid(int(children[0])) if children else None
    except (OSError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """`pid`'s descendants (not itself), from /proc/PID/task/TID/children."""
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                queue += kids
    return found


def waiting_in_poll(pids: list[int], looks: int = 5, interval: float = 0.01) -> bool:
    """Whether a thread of these processes sleeps in select(2), poll(2) or epoll_wait(2) (in
    any of a few looks: a loop spends moments between its waits): a job that may be waiting
    for its terminal without reading it (a job in the background that read would have been
    stopped by the kernel instead)."""
    for look in range(looks):
        if look:
            time.sleep(interval)
        if _in_poll(pids):
            return True
    return False


def _in_poll(pids: list[int]) -> bool:
    proc = ProcReader()
    for pid in pids:
        with contextlib.suppress(OSError, ProcessGone):
            if any(wait.wchan.startswith(POLL_WAITS) for wait in proc.thread_waits(pid)):
                return True
    return False




def ns_pid(pid: int) -> int | None:
    """A task's pid in its own (innermost) PID namespace: NSpid's last field."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return pid
