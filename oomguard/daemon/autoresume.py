"""Paged-out trees continued once their memory fits again, by the auto-restore rule: the
cgroup's usage plus what was paged out plus restore_margin stays under the threshold for
restore_quiet without a break. One tree a turn, oldest first. A tree whose cgroup no guard
watches waits for `oomguard resume`; one that ended meanwhile (killed while stopped) leaves
the record, and the swap files nothing needs any more are switched off and deleted. A tree held
by SIGSTOP (cgroup v1, a traced tree) that someone continued meanwhile (its shell's `fg`, a
`kill -CONT`) is stopped again at once: its memory is not there to run in."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from oomguard.daemon.guards import CgroupGuard
from oomguard.policy.pressure import restore_fits
from oomguard.respond.pageoutstep import PageoutTools


class AutoResumer:
    def __init__(self, tools: PageoutTools, log: Any, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tools = tools
        self.log = log
        self.clock = clock
        self._quiet_since: dict[str, float] = {}

    def held(self) -> frozenset[int]:
        """The tasks of every paged-out tree: never victims while they are paged out (a
        checkpoint would take their stop for their user's)."""
        return frozenset(pid for tree in self.tools.record.trees() for pid in tree.pids)

    def at_stop(self, resume: bool) -> None:
        """A clean stop: every paged-out tree continued (`resume`: pageout_at_stop =
        "resume"), or kept stopped, and said so, never silently: `oomguard resume` or the
        next daemon continues them."""
        if resume:
            resumer = self.tools.resumer()
            for tree in self.tools.record.trees():
                done = resumer.resume(tree)
                self.log.warning("pageout.resumed", paged_out_id=done.tree.id,
                                 pid=done.tree.root_pid, at_stop=True, continued=done.continued,
                                 gone=done.gone, swap_removed=done.swap_removed,
                                 swap_kept=done.swap_kept or None, hold_left=done.hold_left or None)
        kept = [tree.id for tree in self.tools.record.trees()]
        if kept:
            self.log.warning("pageout.kept", paged_out=kept, explanation="paged out and kept "
                             "stopped across the stop (pageout_at_stop = \"keep\"); the next "
                             "daemon continues them once they fit, or `oomguard resume ID`")

    def tick(self, guard_of: Callable[[str], CgroupGuard | None]) -> bool:
        """One look; True while any paged-out tree is left (looked at again soon)."""
        resumer = self.tools.resumer()
        for done in resumer.ended():
            self.log.warning("pageout.ended", paged_out_id=done.tree.id, pid=done.tree.root_pid,
                             swap_removed=done.swap_removed, explanation="every task of the "
                             "paged-out tree has ended (killed while stopped); its swap is free")
        trees = sorted(self.tools.record.trees(), key=lambda t: t.since)
        for tree in trees:
            again = resumer.restop(tree)
            if again:
                self.log.warning("pageout.restopped", paged_out_id=tree.id, pid=tree.root_pid,
                                 stopped=again, explanation="continued by another process (a "
                                 "shell's fg, a kill -CONT) while its memory is paged out: "
                                 f"stopped again; `oomguard resume {tree.id}` continues it")
        now = self.clock()
        for tree in trees:
            guard = guard_of(tree.cgroup)
            if guard is None:
                self._quiet_since.pop(tree.id, None)
                continue
            snap = None
            with contextlib.suppress(OSError):
                snap = guard.cgroup.snapshot()
            if snap is None or not restore_fits(snap, tree.paged_bytes, guard.spec.restore_margin,
                                                guard.spec.threshold):
                self._quiet_since.pop(tree.id, None)
                continue
            since = self._quiet_since.setdefault(tree.id, now)
            if now - since < guard.spec.restore_quiet:
                continue
            self._quiet_since.pop(tree.id, None)
            done = resumer.resume(tree)
            self.log.warning("pageout.resumed", paged_out_id=tree.id, pid=tree.root_pid,
                             cgroup=guard.name, auto=True, continued=done.continued,
                             gone=done.gone, swap_removed=done.swap_removed,
                             swap_kept=done.swap_kept or None, hold_left=done.hold_left or None,
                             usage=snap.usage_bytes,
                             paged_bytes=tree.paged_bytes)
            break  # one a turn: the next looks at the memory again
        return bool(self.tools.record.trees())
