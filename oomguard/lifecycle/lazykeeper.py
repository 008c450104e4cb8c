"""The keeper of a lazy restore: `python -m oomguard.lifecycle.lazykeeper CHECKPOINT_DIR LOCK_FD`, started by
oomguard/lifecycle/lazyrestore.py in a session of its own, so it outlives the CLI (or the daemon) as the
restored job and the lazy-pages daemon do.

It holds LOCK_FD (the checkpoint's restore lock, an flock inherited from the restore) for as
long as pages stream in, verifies the pages files meanwhile (hashing them from the page cache
behind the lazy-pages daemon), is told on stdin which tree was restored (`go ROOT LAZYPID`,
or `abort LAZYPID`: the restore failed; end of file: its parent died), and ends once the
lazy-pages daemon has ended (every page is in, or the job is gone) and the pages are verified.
A mismatch kills the restored tree and the lazy-pages daemon, and sets the checkpoint back to
"checkpointed" (an eager restore will refuse it, naming the file). Its account goes to
CHECKPOINT_DIR/lazy.json; its messages to lazy-keeper.log beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from oomguard.model.errors import StoreError
from oomguard.sense.fdwait import wait_readable
from oomguard.store.checkpoints import IMAGES, STATE_CHECKPOINTED, Store
from oomguard.store.criu_hook import drop_cache, tree_pids
from oomguard.store.integrity import find_sums, read_sums
from oomguard.store.verify import RestoreVerifier

LAZY_STATUS = "lazy.json"  # the keeper's account, written when it ends
GIVE_UP_AFTER = 7 * 86400.0  # a job that never touches its last pages: the daemon waits, we too


def _say(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} oomguard lazy keeper: {text}", file=sys.stderr,
          flush=True)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _orders() -> list[str]:
    """The restore's word on stdin: ["go", ROOT, LAZY], ["abort", LAZY] or [] (no word)."""
    try:
        return sys.stdin.readline().split()
    except (OSError, ValueError):
        return []


def _wait_gone(pid: int, done: threading.Event | None, deadline: float) -> bool:
    """Until process `pid` has ended (True), or `done` is set first, or the deadline passes."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        while time.monotonic() < deadline and (done is None or not done.is_set()):
            if wait_readable(pidfd, 0.05):
                return True
        return False
    finally:
        os.close(pidfd)


def _set_back(work_dir: Path, reason: str) -> None:
    """The checkpoint is not restored after all: its images are damaged."""
    store = Store(work_dir.parent)
    try:
        meta = store.get(work_dir.name)
        meta.state = STATE_CHECKPOINTED
        meta.restored_pid = None
        meta.extra["lazy_restore_failed"] = reason
        store.update(meta)
    except (OSError, StoreError) as exc:
        _say(f"cannot set the checkpoint back to checkpointed: {exc}")


def keep(work_dir: Path) -> dict[str, object]:
    images = work_dir / IMAGES
    started = time.time()
    sums_file, algorithm = find_sums(work_dir)
    # No reads asked for ahead (the eager restore's verifier asks for 64 MiB): the lazy-pages
    # daemon reads every page anyway (on demand, then the rest in order), and reads queued
    # ahead of it delay the job's faults. On this VM, 1 GiB, 8 restores each way: the job's
    # first beat 0.18-1.34 s after the command (4 of 8 over 1 s), every page in after 2.2-3.6 s;
    # without: 0.18-0.39 s, and 1.3-2.3 s.
    verifier = RestoreVerifier(images, algorithm, read_sums(sums_file), sums_file.name, ahead=0)
    orders = _orders()  # CRIU's own reads come first: nothing is read here until then
    status: dict[str, object] = {"started_at": started}
    if len(orders) != 3 or orders[0] != "go" or not all(o.isdigit() for o in orders[1:]):
        if len(orders) == 2 and orders[1].isdigit():
            _kill([int(orders[1])])
        _say(f"restore given up ({' '.join(orders) or 'no word from it'})")
        return {**status, "outcome": "aborted"}
    root, lazy = int(orders[1]), int(orders[2])
    status.update(root_pid=root, lazy_pages_pid=lazy, running_at=time.time())
    stop, gone, verified = threading.Event(), threading.Event(), threading.Event()
    problems: list[str] = []

    def check() -> None:
        # Hashed from the page cache behind the lazy-pages daemon, which reads every page
        # anyway (on demand, then the rest in order): no second read, nothing in the way of
        # the job's faults. Once it has ended, what the cache lost is read outright.
        try:
            problems.extend(verifier.follow_pages(stop.is_set, gone.is_set))
        finally:
            verified.set()
    threading.Thread(target=check, name="lazy-verifier", daemon=True).start()
    deadline = time.monotonic() + GIVE_UP_AFTER
    while not (verified.is_set() and (gone.is_set() or problems)):
        if not gone.is_set():
            if _wait_gone(lazy, None if verified.is_set() else verified, deadline):
                status["resident_at"] = time.time()
                gone.set()
        else:
            verified.wait(0.05)
        if time.monotonic() >= deadline:
            stop.set()
            return {**status, "outcome": "gave up waiting"}
    if problems:
        reason = "; ".join(problems)
        _kill([*tree_pids(root), lazy])
        _say(f"damaged images ({reason}): restored tree {root} killed")
        _set_back(work_dir, reason)
        return {**status, "outcome": "damaged", "problems": problems,
                "verified_at": time.time()}
    status.update(outcome="resident", verified_at=time.time(),
                  pages_bytes=verifier.pages_bytes)
    return status


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m oomguard.lifecycle.lazykeeper CHECKPOINT_DIR LOCK_FD", file=sys.stderr)
        return 2
    work_dir = Path(argv[0])
    lock_fd = int(argv[1])  # held, not used: it closes when we end
    try:
        status = keep(work_dir)
    except (OSError, StoreError) as exc:
        _say(f"failed: {exc}")
        status = {"outcome": f"failed: {exc}"}
    with contextlib.suppress(OSError):
        drop_cache([str(p) for p in (work_dir / IMAGES).iterdir() if p.is_file()])
    with contextlib.suppress(OSError):
        Store(work_dir.parent).write_private(work_dir / LAZY_STATUS,
                                             json.dumps(status, indent=2) + "\n")
    os.close(lock_fd)
    return 0 if status.get("outcome") in ("resident", "aborted") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
