"""A fork storm that outgrows its cgroup (drill): the root forks ~`rate` children a second;
each child lives a few tens of milliseconds, half of them fork a grandchild first (which
outlives its parent: the root is a child subreaper, so it stays in the tree); a grower child
takes 4 MiB every 20 ms after a warm-up. Every process appends `start PID T` when it begins
and `exit PID T` just before it ends (T: time.time()), the grower `grow PID MiB T` for each
step: whatever runs after the freeze leaves a line with a later T.

At most MAX_LIVE of its children and orphaned grandchildren live at once (the root counts
forks against what it reaps): a machine slowed down does not pile up hundreds of them, each a
CRIU image of the interpreter's ~8 MiB.

    forkstorm.py LOG TARGET_MIB [RATE] [WARMUP_S] [MAX_LIVE]
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def line(fd: int, *fields: object) -> None:
    os.write(fd, (" ".join(str(f) for f in fields) + f" {time.time():.6f}\n").encode())


def short_life(fd: int, lifetime: float, fork_again: bool) -> None:
    """A child (or grandchild): says so, maybe forks in turn, lives a little, says so."""
    line(fd, "start", os.getpid())
    if fork_again and os.fork() == 0:
        short_life(fd, lifetime * 1.5, False)
    time.sleep(lifetime)
    line(fd, "exit", os.getpid())
    os._exit(0)


def grow(fd: int, target_mib: int, warmup: float) -> None:
    line(fd, "start", os.getpid())
    time.sleep(warmup)
    chunks = []
    count = 0
    while True:
        count += 1
        if len(chunks) * 4 < target_mib:
            chunks.append(bytes([count % 251]) * (4 << 20))
        line(fd, "grow", os.getpid(), len(chunks) * 4)
        time.sleep(0.02)


def main() -> int:
    log_path, target_mib = sys.argv[1], int(sys.argv[2])
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else 1000.0
    warmup = float(sys.argv[4]) if len(sys.argv) > 4 else 1.5
    max_live = int(sys.argv[5]) if len(sys.argv) > 5 else 60
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return 1
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    line(fd, "start", os.getpid())
    if os.fork() == 0:
        grow(fd, target_mib, warmup)
    forked = reaped = 0
    began = time.monotonic()
    while True:
        capped = forked + forked // 2 - reaped >= max_live  # half the children fork again
        if not capped:
            forked += 1
            if os.fork() == 0:
                short_life(fd, 0.02 + (forked % 5) * 0.005, forked % 2 == 0)
        ahead = began + forked / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
        elif capped:
            time.sleep(0.001)
        while True:  # reap children and the orphaned grandchildren (we are their subreaper)
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if done == 0:
                break
            reaped += 1


if __name__ == "__main__":
    sys.exit(main())
