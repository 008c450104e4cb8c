"""Resuming a paged-out tree: its tasks continued (only the same processes, still stopped;
or its frozen cgroup thawed, its tasks moved back to their own cgroup, and it removed),
its entry gone from the record, and the swap files made for it switched off and deleted once
no other paged-out tree needs them. The tree takes its pages back from swap as it touches
them; a swap file's swapoff reads what is left back in (charged to the tree's cgroup)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.act.cgrouphold import CgroupHold
from oomguard.act.frozen import USER_STOPPED_STATE, continued
from oomguard.act.pageout import PageoutError
from oomguard.act.swapfiles import SwapFiles
from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import ProcReader
from oomguard.store.pagedout import PagedOutRecord, PagedOutTree


@dataclass
class Resumed:
    tree: PagedOutTree
    continued: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)  # ended meanwhile (killed, or its PID reused)
    swap_removed: list[str] = field(default_factory=list)
    swap_kept: str = ""  # why a swap file of it could not be removed yet (tried again later)
    hold_left: str = ""  # why its frozen cgroup could not be released (its tasks stay held)


class Resumer:
    def __init__(self, record: PagedOutRecord, swap: SwapFiles,
                 proc: ProcReader | None = None, holds: CgroupHold | None = None) -> None:
        self.record = record
        self.swap = swap
        self.proc = proc or ProcReader()
        self.holds = holds or CgroupHold()

    def resume(self, tree: PagedOutTree) -> Resumed:
        """Its hold released (a frozen cgroup thawed, or its SIGSTOP continued) and its entry
        gone. A frozen cgroup that cannot be released keeps the entry (`hold_left`): the tree
        is still held, and a later resume tries again."""
        done = Resumed(tree)
        if tree.hold:
            try:
                moved = set(self.holds.release(Path(tree.hold)))
            except (OSError, ValueError) as exc:
                done.hold_left = f"{tree.hold}: {getattr(exc, 'strerror', None) or exc}"
                return done
            done.continued = [pid for pid in tree.pids if pid in moved]
        for pid, started in tree.tasks:
            if pid in done.continued:
                continue
            try:
                stat = self.proc.stat(pid)
            except ProcessGone:
                done.gone.append(pid)
                continue
            if stat.starttime != started or stat.state in ("Z", "X"):
                done.gone.append(pid)
                continue
            # T: stopped by oomguard's SIGSTOP; t: a traced task stopped by it (its tracer,
            # stopped too, is continued with it and lets it run on)
            if stat.state in (USER_STOPPED_STATE, "t"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    done.continued.append(pid)
        self.record.remove(tree.id)
        self.release_swap(done)
        return done

    def restop(self, tree: PagedOutTree) -> list[int]:
        """A tree held by SIGSTOP whose tasks someone continued (its shell's `fg`, a `kill
        -CONT`) while its memory is paged out: those tasks stopped again. Returns them. (A
        tree whose frozen cgroup a crash kept from being made is held by SIGSTOP too.)"""
        if tree.hold and Path(tree.hold).is_dir():
            return []
        again = []
        for pid, started in tree.tasks:
            if self._gone(pid, started) or not continued(self.proc, pid):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                again.append(pid)
        return again

    def ended(self) -> list[Resumed]:
        """Trees every task of which has ended (killed while paged out): their entries gone,
        their swap freed."""
        over = []
        for tree in self.record.trees():
            if all(self._gone(pid, started) for pid, started in tree.tasks):
                over.append(self.resume(tree))
        return over

    def release_swap(self, done: Resumed | None = None) -> list[str]:
        """Switch off and delete oomguard's swap files that no paged-out tree needs (and any
        a crash left switched off). Returns the ones removed; a failed swapoff (no room for
        its pages yet) keeps the file, said in `done.swap_kept`."""
        needed = self.record.swap_in_use()
        removed = []
        for area in self.swap.ours():
            if area.path in needed:
                continue
            try:
                self.swap.remove(Path(area.path))
                removed.append(area.path)
            except PageoutError as exc:
                if done is not None:
                    done.swap_kept = str(exc)
        for path in self.swap.leftovers():
            if str(path) not in needed:
                with contextlib.suppress(OSError):
                    path.unlink()
        if done is not None:
            done.swap_removed = removed
        return removed

    def _gone(self, pid: int, started: int) -> bool:
        try:
            stat = self.proc.stat(pid)
        except ProcessGone:
            return True
        return stat.starttime != started or stat.state in ("Z", "X")
