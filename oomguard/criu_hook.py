"""CRIU action script: the checkpoint's commit point, and the restored tree's wake-up.

CRIU execs this (through a two-line sh wrapper) for every action. On `post-dump` it makes the
images durable (fdatasync each file and the directory) and drops their page cache
(POSIX_FADV_DONTNEED after the sync; fsync alone does not uncharge the cache from the memory
cgroup). A non-zero exit makes CRIU resume the tree instead of killing it, so a checkpoint that
is not on disk never costs the process its life.

Standard library only: it runs as `python -I criu_hook.py`, outside the package's import path.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _regular_files(directory: str) -> list[str]:
    paths = (os.path.join(directory, name) for name in sorted(os.listdir(directory)))
    return [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]


def sync_and_drop(directory: str) -> tuple[int, float, float]:
    """fdatasync every regular file in `directory` and the directory, then drop their page
    cache; returns (bytes seen, seconds syncing, seconds dropping)."""
    files = _regular_files(directory)
    total = 0
    start = time.monotonic()
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    synced = time.monotonic()
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total, synced - start, time.monotonic() - synced


def tree_pids(root: int, proc: str = "/proc") -> list[int]:
    """`root` and its descendants, from /proc/PID/task/TID/children."""
    found, index = [root], 0
    while index < len(found):
        pid = found[index]
        index += 1
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"{proc}/{pid}/task/{tid}/children") as handle:
                    found += [int(child) for child in handle.read().split()]
            except (OSError, ValueError):
                continue
    return found


def ns_pid(pid: int, proc: str = "/proc") -> int | None:
    """The task's pid in its own (innermost) PID namespace: NSpid's last field."""
    try:
        with open(f"{proc}/{pid}/status") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return pid


def parse_keep(text: str) -> set[int]:
    """OOMGUARD_KEEP_STOPPED: comma-separated namespace pids (anything else is ignored)."""
    return {int(part) for part in text.split(",") if part.strip().isdigit()}


def hung_up_at_exit(pid: int, root: int) -> bool:
    """Whether the kernel would hang up (SIGHUP, then SIGCONT) this task when CRIU exits were
    it left stopped: it is in the restored root's process group, which CRIU's exit orphans in
    CRIU's own session (a job that led its process group but not its session)."""
    try:
        return (os.getsid(root) == os.getsid(0) and os.getpgid(pid) == os.getpgid(root)
                and os.getpgid(root) != os.getpgid(0))
    except OSError:
        return False


def continue_tree(root: int, keep_ns: set[int] | None = None) -> tuple[int, list[int]]:
    """SIGCONT the restored tree (it was dumped stopped, so CRIU restored it stopped), except
    the tasks the user had stopped (`keep_ns`: pids in the tree's own PID namespace). Returns
    (tasks continued, host pids left stopped)."""
    count, kept = 0, []
    for pid in tree_pids(root):
        if keep_ns and ns_pid(pid) in keep_ns and not hung_up_at_exit(pid, root):
            kept.append(pid)
            continue
        try:
            os.kill(pid, signal.SIGCONT)
            count += 1
        except OSError:
            continue
    return count, kept


def main() -> int:
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION")
    if action == "post-resume":
        # Never fail a restore from here: the tree is restored; at worst it stays stopped
        # and oomguard continues it (and CRIU's exit may then hang it up).
        root = os.environ.get("CRTOOLS_INIT_PID", "")
        keep = parse_keep(os.environ.get("OOMGUARD_KEEP_STOPPED", ""))
        if root.isdigit():
            _, kept = continue_tree(int(root), keep)
            if keep:  # CRIU writes this into restore.log
                print(f"oomguard criu hook: left stopped as the user had them: "
                      f"{', '.join(map(str, kept)) or 'none'}", file=sys.stderr)
        return 0
    if action != "post-dump":
        return 0
    directory = os.environ.get("CRTOOLS_IMAGE_DIR")
    if not directory:
        print("oomguard criu hook: CRTOOLS_IMAGE_DIR not set", file=sys.stderr)
        return 1
    try:
        total, sync_s, drop_s = sync_and_drop(directory)
    except OSError as exc:
        print(f"oomguard criu hook: cannot make images durable: {exc}", file=sys.stderr)
        return 1
    # CRIU writes what its action scripts print into dump.log: the benchmarks read this line.
    print(f"oomguard criu hook: {total} bytes, fdatasync {sync_s:.6f} s, "
          f"page cache dropped {drop_s:.6f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
