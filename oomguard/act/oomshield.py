"""cgroup v2's park: while oomguard stops a victim, its tasks carry oom_score_adj -1000.

v2 has no oom_kill_disable, and a SIGSTOP (or cgroup.freeze) takes a task only on its way back
to user space: memory taken inside one system call (mmap with MAP_POPULATE...) runs on to
memory.max, where the kernel's OOM killer would take the job. With no task it may kill, the
kernel fails that allocation instead (a MAP_POPULATE mapping comes back partly populated; a
page fault is retried from user space), and the task stops on its way out. The originals are
written down (with each task's start time and the writer) before -1000 goes in, put back as
soon as the tree has stopped (CRIU saves oom_score_adj with the images), and put back at the
next daemon start if the writer died in between.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import ProcReader
from oomguard.store.ledger import JsonRecord

SHIELD = -1000  # OOM_SCORE_ADJ_MIN: the OOM killer never picks such a task


@dataclass(frozen=True)
class Shielded:
    pid: int
    starttime: int
    original: int
    owner: int  # the oomguard process that wrote -1000
    owner_start: int


class OomShield:
    def __init__(self, path: Path, proc: ProcReader | None = None,
                 owner: int | None = None) -> None:
        self.path = path
        # Not fsync'd: written on the path to SIGSTOP, and it guards against a dead daemon
        # (the next one reads the page cache), not a dead machine.
        self.record = JsonRecord(path, sync=False, mode=0o644)
        self.proc = proc or ProcReader()
        self.proc_root = Path(self.proc.root)  # oom_score_adj is written where it is read
        self.owner = owner if owner is not None else os.getpid()
        self._owner_start = self.proc.starttime(self.owner)
        self._lock = threading.Lock()


    def _load(self) -> list[Shielded]:
        data = self.record.read()
        try:
            return [Shielded(**entry) for entry in data] if isinstance(data, list) else []
        except TypeError:  # not a list of entries
            return []

    def _save(self, entries: list[Shielded]) -> None:
        if not entries:
            self.record.remove()
            return
        self.record.write([asdict(e) for e in entries])

    def _adj_file(self, pid: int) -> Path:
        return self.proc_root / str(pid) / "oom_score_adj"

    def shield(self, pids: list[int], inherited: int | None = None) -> list[int]:
        """Write -1000 to each task, its original noted first. `inherited`: the original of
        tasks that already carry -1000 because they were forked from a shielded parent.
        Returns the pids shielded (a task that is gone, or a kernel that refuses, is left)."""
        done = []
        with self._lock:
            entries = self._load()
            known = {e.pid for e in entries if e.owner == self.owner}
            for pid in pids:
                if pid in known:
                    continue
                try:
                    info = self.proc.process(pid)
                except ProcessGone:
                    continue
                original = info.oom_score_adj
                if original == SHIELD:
                    if inherited is None:
                        continue  # opted out of the OOM killer already: nothing to do
                    original = inherited
                entries.append(Shielded(pid, info.starttime, original, self.owner,
                                        self._owner_start))
                self._save(entries)
                try:
                    self._adj_file(pid).write_text(str(SHIELD))
                except OSError:  # gone, or no CAP_SYS_RESOURCE: unshielded, as before
                    entries.pop()
                    self._save(entries)
                    continue
                done.append(pid)
        return done

    def original_of(self, pid: int) -> int | None:
        return next((e.original for e in self._load() if e.pid == pid), None)

    def unshield(self, pids: list[int] | None = None) -> None:
        """Put the originals back (all of this process's, when `pids` is None)."""
        with self._lock:
            keep = []
            for entry in self._load():
                mine = entry.owner == self.owner and entry.owner_start == self._owner_start
                if mine and (pids is None or entry.pid in pids):
                    self._put_back(entry)
                else:
                    keep.append(entry)
            self._save(keep)

    def _put_back(self, entry: Shielded) -> None:
        try:
            info = self.proc.process(entry.pid)
        except ProcessGone:
            return
        if info.starttime == entry.starttime and info.state not in ("Z", "X"):
            with contextlib.suppress(OSError):
                self._adj_file(entry.pid).write_text(str(entry.original))

    def recover(self) -> list[int]:
        """At start: put back what writers that died left shielded. Returns those pids."""
        restored = []
        with self._lock:
            keep = []
            for entry in self._load():
                alive = entry.owner_start > 0 and self.proc.starttime(entry.owner) == entry.owner_start
                if alive:
                    keep.append(entry)
                    continue
                self._put_back(entry)
                restored.append(entry.pid)
            self._save(keep)
        return restored
