"""CRIU action script: the checkpoint's commit point, and the restored tree's wake-up.

CRIU execs this (through a two-line sh wrapper) for every action. On `post-dump` it makes the
images durable (fdatasync each file and the directory) and drops their page cache
(POSIX_FADV_DONTNEED after the sync; fsync alone does not uncharge the cache from the memory
cgroup). A non-zero exit makes CRIU resume the tree instead of killing it, so a checkpoint that
is not on disk never costs the process its life. Before dropping the cache it lets oomguard's
digester (oomguard/store/digest.py) finish the checksums it took while CRIU wrote, so they are
read from memory, not back from disk.

On `post-restore` (only when oomguard names a gate) it asks oomguard whether the images CRIU
has just read are intact (oomguard/store/verify.py checks them while CRIU reads): anything but
"ok" (a mismatch, no answer, oomguard gone) exits 1, and CRIU kills the restored tree before
it ran a single instruction. On `post-resume` it continues the tree.

oomguard and this script talk through a "gate": two FIFOs, BASE.req (requests) and BASE.ack
(replies), made by oomguard in the root-only checkpoint directory and held open by it, so that
opening BASE.req for writing fails at once (ENXIO) when no oomguard listens, and a reply being
waited for reads as a hang-up when oomguard dies.

Standard library only: it runs as `python -I -S criu_hook.py` (no site: 20 ms less), outside
the package's import path.
"""

from __future__ import annotations

import os
import select
import signal
import stat
import sys
import time

# The gates' environment variables (CRIU passes its environment on to its action scripts).
DIGEST_GATE_ENV = "OOMGUARD_DIGEST_GATE"  # post-dump: "finish your checksums"
VERIFY_GATE_ENV = "OOMGUARD_VERIFY_GATE"  # post-restore: "are the images intact?"
REQUEST_SUFFIX = ".req"
REPLY_SUFFIX = ".ack"
REPLY_OK = "ok"
# post-dump waits this long for the digester: past it the cache is dropped anyway and oomguard
# reads the rest back from disk (slower to commit, but the memory is not held up for it).
DIGEST_WAIT = 5.0
VERIFY_WAIT = 600.0  # post-restore: oomguard answers once it has read every page (or dies)


def _regular_files(directory: str) -> list[str]:
    """CRIU's files in `directory`: not the compressed pages oomguard writes beside them
    (NAME.zst: still being written, or given up and removed, while this runs; the commit makes
    them durable)."""
    paths = (os.path.join(directory, name) for name in sorted(os.listdir(directory))
             if not name.endswith(".zst"))
    return [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]


def sync_files(directory: str) -> tuple[list[str], int, float]:
    """fdatasync every regular file in `directory` and the directory; returns (the files,
    bytes seen, seconds)."""
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
    return files, total, time.monotonic() - start


def drop_cache(files: list[str]) -> float:
    """POSIX_FADV_DONTNEED on each file (after a sync: clean pages go, and their charge to the
    memory cgroup with them); returns seconds."""
    start = time.monotonic()
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.monotonic() - start


def sync_and_drop(directory: str) -> tuple[int, float, float]:
    """fdatasync every regular file in `directory` and the directory, then drop their page
    cache; returns (bytes seen, seconds syncing, seconds dropping)."""
    files, total, synced = sync_files(directory)
    return total, synced, drop_cache(files)


def ask(base: str, message: str) -> int | None:
    """Send `message` through the gate at `base`; returns the fd its reply comes on (see
    answer()), or None when nobody listens there."""
    try:
        fd = os.open(base + REQUEST_SUFFIX, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
                     | os.O_NOFOLLOW)
    except OSError:  # ENXIO: the FIFO has no reader, oomguard is gone; ENOENT: no gate
        return None
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        os.write(fd, message.encode() + b"\n")
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return os.open(base + REPLY_SUFFIX, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                       | os.O_NOFOLLOW)
    except OSError:
        return None


def answer(fd: int, timeout: float) -> str | None:
    """The reply line on `fd` (closed here); None after `timeout` seconds or when oomguard
    hung up without replying."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            events = poller.poll(left * 1000)
            if not events:
                continue
            chunk = os.read(fd, 4096) if events[0][1] & select.POLLIN else b""
            if not chunk:
                return None  # hung up: no writer left
            data += chunk
    except (OSError, InterruptedError):
        return None
    finally:
        os.close(fd)
    return data.split(b"\n", 1)[0].decode(errors="replace")


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


def post_dump(directory: str) -> str:
    """Make the images durable, let oomguard's digester finish (overlapping the sync), drop
    their page cache; returns the line for dump.log. Raises OSError."""
    gate = os.environ.get(DIGEST_GATE_ENV)
    reply = ask(gate, "finish") if gate else None
    files, total, sync_s = sync_files(directory)
    waited = time.monotonic()
    digests = answer(reply, DIGEST_WAIT) if reply is not None else None
    waited = time.monotonic() - waited
    drop_s = drop_cache(files)
    return (f"oomguard criu hook: {total} bytes, fdatasync {sync_s:.6f} s, digests "
            f"{digests or 'not taken'} after {waited:.6f} s, page cache dropped {drop_s:.6f} s")


def post_restore() -> int:
    """The verdict on the images CRIU has read: 0 to go on, 1 (CRIU kills the tree, which has
    not run yet) unless oomguard says they are intact."""
    gate = os.environ.get(VERIFY_GATE_ENV)
    if not gate:
        return 0
    reply = ask(gate, "verdict")
    verdict = answer(reply, VERIFY_WAIT) if reply is not None else None
    if verdict == REPLY_OK:
        return 0
    print(f"oomguard criu hook: images not verified ({verdict or 'no answer from oomguard'}): "
          "the restored tree is killed before it runs", file=sys.stderr)
    return 1


def main() -> int:
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION")
    if action == "post-restore":
        return post_restore()
    if action == "post-resume":
        # Never fail a restore from here: the tree is restored; at worst it stays stopped
        # and oomguard continues it (and CRIU's exit may then hang it up).
        if os.environ.get("OOMGUARD_CONTINUE_LATER"):
            return 0  # the restore runs under the job's session leader: continued after it
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
        line = post_dump(directory)
    except OSError as exc:
        print(f"oomguard criu hook: cannot make images durable: {exc}", file=sys.stderr)
        return 1
    # CRIU writes what its action scripts print into dump.log: the benchmarks read this line.
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
