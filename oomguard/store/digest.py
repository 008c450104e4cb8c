"""Checksums of a dump's images taken while CRIU writes them, from the page cache.

Reading the images back after the post-dump action dropped their cache cost a second per GB,
after the process was already dead: the checkpoint was not whole until then. Instead a thread
follows the images directory during the dump and hashes each pages-*.img as it grows (CRIU
writes those front to back, once: its page transfer splices pages onto the end of the file).
Each stretch hashed is handed to writeback at once (POSIX_FADV_DONTNEED: writes dirty pages,
drops clean ones). When CRIU reaches its post-dump action, the action script
(oomguard/store/criu_hook.py) asks, through a gate (oomguard/store/hookgate.py), for the rest: the digester
hashes what remains of every image while it is still in the page cache, and the script drops
the cache only after the answer (it fdatasyncs meanwhile). Should the script not reach us, or
not wait, the digester finishes after CRIU from wherever the data then is: slower, never wrong.

The commit (Store.commit) takes a digest only for a file still of the size, mtime and inode it
was hashed at, and hashes anything else (stats-dump, which CRIU writes after the post-dump
action) itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from oomguard.store.compression import SUFFIX
from oomguard.store.criu_hook import DIGEST_GATE_ENV
from oomguard.store.hookgate import Gate
from oomguard.store.integrity import (
    READ_BLOCK,
    Hasher,
    digest_file,
    hash_block,
    hasher_factory,
    image_files,
)

# Files hashed as they grow: CRIU appends to them and never goes back (criu/page-xfer.c).
GROWING = re.compile(r"^pages-\d+\.img$")
FINISH = "finish"
FOLLOW_INTERVAL = 0.004  # seconds between looks at the growing files while CRIU writes
GATE_NAME = ".digest"  # beside images/: BASE.req and BASE.ack


@dataclass(frozen=True)
class FileDigest:
    digest: str
    size: int
    mtime_ns: int
    inode: int

    def matches(self, st: os.stat_result) -> bool:
        return (st.st_size, st.st_mtime_ns, st.st_ino) == (self.size, self.mtime_ns, self.inode)


@dataclass(frozen=True)
class Digests:
    algorithm: str
    files: dict[str, FileDigest]
    # Finished in CRIU's post-dump action, before it synced: every file named here was then
    # fdatasynced by the action (CRIU succeeded, so the action did), and needs no sync again.
    at_post_dump: bool
    finish_s: float  # how long the finish took (what the post-dump action waited for)
    followed_bytes: int  # hashed while CRIU was still writing
    # pages files also written compressed beside them (NAME.zst, complete, in `files` too):
    # name -> raw bytes (oomguard/store/compression.py)
    compressed: dict[str, int] = field(default_factory=dict)


@dataclass
class _Open:
    fd: int
    inode: int
    hasher: Hasher
    offset: int = 0
    advised: int = 0  # bytes up to which writeback was started and the cache let go


class ImageDigester:
    """Follows `images` from start() until result() (or abandon()); `gate`: where CRIU's
    post-dump action asks it to finish."""

    def __init__(self, images: Path, algorithm: str, gate: Gate | None = None, *,
                 interval: float = FOLLOW_INTERVAL, drop_behind: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.images = images
        self.gate = gate
        self.interval = interval
        self.clock = clock
        self.algorithm = algorithm
        self.drop_behind = drop_behind  # False: a packer reads these pages after us
        self._new_hasher = hasher_factory(algorithm)
        self._buffer = bytearray(READ_BLOCK)
        self._open: dict[str, _Open] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done: Digests | None = None
        self._failed: BaseException | None = None

    @classmethod
    def following(cls, images: Path, algorithm: str,
                  drop_behind: bool = True) -> ImageDigester:
        """A digester already following `images`, with its gate beside them (without one,
        where the FIFOs cannot be made: then it finishes after CRIU)."""
        try:
            gate: Gate | None = Gate(images.parent, GATE_NAME)
        except OSError:
            gate = None
        digester = cls(images, algorithm, gate, drop_behind=drop_behind)
        digester.start()
        return digester

    def env(self) -> dict[str, str]:
        """For CRIU's environment: where its post-dump action finds the gate."""
        return {DIGEST_GATE_ENV: str(self.gate.base)} if self.gate is not None else {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="image-digester", daemon=True)
        self._thread.start()

    def result(self) -> Digests | None:
        """After CRIU exited successfully: the digests (finished now if the post-dump action
        did not ask for them); None if hashing failed (the commit then reads the images)."""
        self._join()
        try:
            if self._done is None and self._failed is None:
                self._done = self._finish(at_post_dump=False)
        except OSError as exc:
            self._failed = exc
        finally:
            self._close_all()
        return None if self._failed is not None else self._done

    def abandon(self) -> None:
        """The dump failed: stop, keep nothing."""
        self._join()
        self._close_all()

    def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                request = self.gate.request(self.interval) if self.gate is not None else None
                if request == FINISH:
                    self._answer_finish()
                    return
                if self.gate is None:
                    self._stop.wait(self.interval)
                self._follow()
        except Exception as exc:  # whatever it was, the post-dump action must get its answer
            self._failed = exc
            if self.gate is not None:
                with contextlib.suppress(OSError):
                    self.gate.reply(f"failed: {exc}")

    def _answer_finish(self) -> None:
        try:
            self._done = self._finish(at_post_dump=True)
        except OSError as exc:
            self._failed = exc
            if self.gate is not None:
                self.gate.reply(f"failed: {exc}")
            return
        if self.gate is not None:
            self.gate.reply(f"ok in {self._done.finish_s:.6f} s")

    def _follow(self) -> None:
        """Hash what CRIU has appended to the growing files since the last look."""
        try:
            names = [name for name in os.listdir(self.images) if GROWING.match(name)]
        except FileNotFoundError:
            return
        for name in sorted(names):
            state = self._open_file(name)
            if state is not None:
                self._hash_to(state, os.fstat(state.fd).st_size)
                if self.drop_behind and state.offset > state.advised:
                    # Hashed: start writing it back now and let its clean pages go, so that
                    # CRIU's small memory cgroup does not stall its writes in reclaim and
                    # the post-dump fdatasync finds little left to write (measured: 6-12 ms
                    # instead of 60-90 ms for 1 GiB; 256 MiB dumps 0.43-0.50 s, not 0.54-0.71).
                    os.posix_fadvise(state.fd, state.advised, state.offset - state.advised,
                                     os.POSIX_FADV_DONTNEED)
                    state.advised = state.offset

    def _finish(self, at_post_dump: bool) -> Digests:
        start = self.clock()
        followed = sum(state.offset for state in self._open.values())
        files = {}
        for path in image_files(self.images):
            if path.name.endswith(SUFFIX):
                continue  # our own output: hashed once complete, below
            state = self._open.get(path.name)
            current = path.lstat()
            if state is not None and state.inode != current.st_ino:
                self._forget(path.name)  # replaced since we began: start again on the new file
                state = None
            state = state or self._open_file(path.name)
            if state is None:
                continue
            st = os.fstat(state.fd)
            self._hash_to(state, st.st_size)
            files[path.name] = FileDigest(state.hasher.hexdigest(), st.st_size, st.st_mtime_ns,
                                          st.st_ino)
        return Digests(self.algorithm, files, at_post_dump, self.clock() - start, followed)

    def _open_file(self, name: str) -> _Open | None:
        state = self._open.get(name)
        if state is None:
            try:
                fd = os.open(self.images / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                return None
            state = _Open(fd, os.fstat(fd).st_ino, self._new_hasher())
            self._open[name] = state
        return state

    def _forget(self, name: str) -> None:
        os.close(self._open.pop(name).fd)

    def _hash_to(self, state: _Open, size: int) -> None:
        view = memoryview(self._buffer)
        while count := hash_block(state.fd, state.hasher, view, state.offset, size):
            state.offset += count

    def _close_all(self) -> None:
        if self.gate is not None:
            self.gate.close()
        for state in self._open.values():
            with contextlib.suppress(OSError):
                # What we read of a file CRIU no longer has in its cache was charged to us.
                os.posix_fadvise(state.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(state.fd)
        self._open.clear()


def with_packed(digests: Digests | None, packed: dict[str, Path],
                raw_bytes: dict[str, int]) -> Digests | None:
    """`digests` plus the compressed pages files made beside them (oomguard/store/compression.py:
    name -> the finished NAME.zst), each hashed now (just written: from the page cache)."""
    if digests is None or not packed:
        return digests
    files = dict(digests.files)
    compressed = {}
    for name, stored in packed.items():
        if name not in files:
            continue
        st = stored.lstat()
        files[stored.name] = FileDigest(digest_file(stored, digests.algorithm, drop_cache=False),
                                        st.st_size, st.st_mtime_ns, st.st_ino)
        compressed[name] = raw_bytes[name]
    return replace(digests, files=files, compressed=compressed)
