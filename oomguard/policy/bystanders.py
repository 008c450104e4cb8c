"""Which other processes of a victim's memory cgroup are held stopped while it is dumped.

A cgroup's limit is shared: while one job is stopped and dumped (its memory is charged until
CRIU kills it, and the room lifted for the dump is meant for CRIU's parasite and the victim's
last steps), another job of the same cgroup that keeps growing reaches the limit. There a page
fault waits, but on cgroup v1 with oom_kill_disable a charge made inside a system call (the
page cache of a write(2), kernel memory) fails with ENOMEM, and the parasite's own memory may
be refused (a failed dump). So the others are stopped for the dump and continued after it.

Pure: the processes as read from /proc in, the pids to stop out."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

# Left as they are: stopped by the user (T), traced (t: a debugger, or a CRIU at work), dead.
LEFT_ALONE_STATES = frozenset("TtZX")


@dataclass(frozen=True)
class Bystander:
    """One other process of the cgroup, as /proc/PID/stat shows it."""

    pid: int
    ppid: int
    state: str
    # Under ptrace (/proc/PID/status TracerPid): a CRIU at work on it shows R or S while its
    # parasite runs in it, and a stop signal then makes the dump fail.
    traced: bool = False


def to_hold(found: Iterable[Bystander], victim: Collection[int],
            spared: Collection[int]) -> list[int]:
    """The pids to stop: every process found but the victim's tree and anything descended
    from it (a child forked while the tree was being stopped belongs to the tree, which the
    freeze catches), the `spared` (oomguard, its ancestors, what it runs, the one asking for
    the checkpoint), and those stopped, traced (a CRIU of a dead daemon still dumping it: the
    standby stopped it there, and the dump failed) or dead already."""
    found = list(found)
    parent = {b.pid: b.ppid for b in found}
    in_tree = set(victim)

    def descends_from_tree(pid: int) -> bool:
        seen: set[int] = set()
        while pid in parent and pid not in seen:
            seen.add(pid)
            pid = parent[pid]
            if pid in in_tree:
                return True
        return False

    return [b.pid for b in found
            if b.pid not in in_tree and b.pid not in spared
            and b.state not in LEFT_ALONE_STATES and not b.traced
            and not descends_from_tree(b.pid)]
