"""The chain's `pageout` step: what CRIU cannot checkpoint is moved out of RAM instead, and
kept stopped until its memory fits again (issue 29).

The tree is held stopped (frozen again if the failed checkpoint thawed it), swap is found for
its resident memory (the machine's own areas first; else oomguard's own swap file in the
store's file system, within the store's budget), and every task's private memory is paged
out (process_madvise MADV_PAGEOUT). The step settles once the cgroup is back under its
threshold: the tree is then recorded as paged out (STORE/.paged-out.json) and left stopped,
its frozen-ledger entries cleared (a crash must not continue it into memory that is not
there). On cgroup v2 the tree is then held by a frozen cgroup of its own instead of its
SIGSTOP (oomguard.act.cgrouphold: a `fg` or SIGCONT cannot continue it, a crash leaves it
held); elsewhere (v1, a traced tree) it stays stopped, and the daemon stops it again should
anyone continue it (oomguard.daemon.autoresume). `oomguard resume ID|PID`, or the daemon once
the tree fits by the auto-restore rule, continues it (oomguard.lifecycle.pagedresume).
Anything that keeps the step from working (no rights, no room for a swap file, swapon
refused, nothing taken) lets the next step run, and the event says why.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from oomguard.act.cgrouphold import CgroupHold, HoldRefused
from oomguard.act.pageout import PageoutError, ProcessPager
from oomguard.act.swapfiles import SwapFiles
from oomguard.config.actions import Step
from oomguard.lifecycle.pagedresume import Resumer
from oomguard.model.errors import CgroupGone, ProcessGone, StoreError
from oomguard.model.units import format_size
from oomguard.respond.chainstate import CONTINUE, ChainOutcome, ChainResult, ChainRun, Settled, StepResult
from oomguard.sense.swaps import SwapReader
from oomguard.store.names import SWAP_DIR
from oomguard.store.pagedout import PagedOutRecord, PagedOutTree

if TYPE_CHECKING:
    from oomguard.respond.steptools import StepTools

SWAP_SLACK = 32 << 20  # a swap file is made this much larger than the tree's memory
HOLD_WAIT = 10.0  # seconds for a tree moved into its frozen cgroup to be seen frozen


@dataclass
class PageoutTools:
    """What the step works with, each replaceable by a test."""

    record: PagedOutRecord
    swap: SwapFiles
    pager: ProcessPager = field(default_factory=ProcessPager)
    swaps: SwapReader = field(default_factory=SwapReader)
    wall_clock: Callable[[], float] = time.time
    holds: Callable[[Path], CgroupHold] = CgroupHold  # for a cgroup v2 mount

    @classmethod
    def for_store(cls, root: Path) -> PageoutTools:
        return cls(PagedOutRecord(root), SwapFiles(root / SWAP_DIR))

    def resumer(self) -> Resumer:
        return Resumer(self.record, self.swap, holds=self.holds(Path("/")))


class PageoutAction:
    def __init__(self, tools: StepTools) -> None:
        self.tools = tools

    def run(self, step: Step, run: ChainRun) -> StepResult:
        from oomguard.respond.chainsteps import FreezeAction  # the freeze is that step's

        tools, po = self.tools, self.tools.pageout
        foreign = self._traced_from_outside(run)
        if foreign:  # (before any stop: a signal must not reach a task a CRIU is dumping)
            return self._failed(run, foreign)
        if not run.frozen:  # a failed checkpoint thawed it: stopped again
            FreezeAction(tools).run(step, run)
        if not run.frozen:
            return self._failed(run, "every task of the tree was stopped by its user")
        need = sum(self._resident(pid) for pid in run.frozen)
        made: list[str] = []
        try:
            free = po.swaps.free()
            if free < need:
                size = need - free + SWAP_SLACK
                self._room_on_disk(size)
                made.append(str(po.swap.make(size)))
            advised = self._page_out_within_swap_limit(run, need)
        except ProcessGone:
            self._give_back(made)
            raise
        except PageoutError as exc:
            self._give_back(made)
            return self._failed(run, exc.reason)
        if run.still_pressing():
            self._give_back(made)
            return self._failed(run, f"{format_size(advised)} paged out, and the cgroup is "
                                "still over its threshold")
        tree, stopped_why = self._hold(run, self._entry(run, advised, made))
        with contextlib.suppress(OSError):
            tools.checkpointer.ledger.clear(run.frozen)
        held = set(run.frozen)
        run.recorded = [pid for pid in run.recorded if pid not in held]
        for pid in held:  # a dead run's stops among them: held now, not continued at the end
            run.left_over_starts.pop(pid, None)
        run.frozen = []
        tools.log.warning("victim.paged_out", paged_out_id=tree.id,
                          paged_bytes=advised, swap_files=list(made),
                          held_by=f"cgroup.freeze {tree.hold}" if tree.hold else "SIGSTOP",
                          hold_why=stopped_why or None,
                          explanation="kept stopped until its memory fits again, or "
                          f"`oomguard resume {tree.id}`", **run.fields)
        return Settled(ChainOutcome(ChainResult.PAGED_OUT, str(step),
                                    f"{format_size(advised)} paged out ({tree.id})"))

    def _page_out_within_swap_limit(self, run: ChainRun, need: int) -> int:
        """cgroup v2: a memory.swap.max with too little room lifted for the page-out only."""
        undo = None
        if run.cgroup is not None:
            try:
                undo = run.cgroup.lift_swap(need)
            except (OSError, CgroupGone) as exc:
                raise PageoutError(f"cannot make room under memory.swap.max: {exc}") from exc
        try:
            return self._page_out(run)
        finally:
            if undo is not None:
                with contextlib.suppress(OSError, CgroupGone):
                    undo()

    def _page_out(self, run: ChainRun) -> int:
        """Every task's private memory advised out, then the cgroup's charge for it freed:
        a page whose write to swap has not ended when process_madvise returns (a swap file's
        writes are asynchronous) stays in the swap cache, unmapped and clean but charged to
        the cgroup, until reclaim takes it. So the cgroup is made to reclaim that much now,
        the coldest pages first, which are these: v2 through memory.reclaim, v1 by its limit
        set below usage for a moment (recorded first: oomguard.act.lifts.LimitLifts.lower).
        Returns what process_madvise took the advice for."""
        pager, cgroup = self.tools.pageout.pager, run.cgroup
        before = self._usage(run)
        advised = sum(pager.page_out(pid).advised_bytes for pid in run.frozen)
        if cgroup is None:  # (even where the pressure reads as passed: swap cache is not
            return advised  # resident memory, but it is charged, and a resume must fit it)
        swapped = sum(self._swapped(pid) for pid in run.frozen)
        charged = swapped - max(0, before - self._usage(run))  # still in the swap cache
        if charged <= 0:
            return advised
        with contextlib.suppress(OSError, CgroupGone):
            if not cgroup.reclaim(charged):
                target = self._usage(run) - charged
                if target > 0:
                    release = self.tools.checkpointer.lifts.lower(cgroup, target)
                    release()
        return advised

    def _usage(self, run: ChainRun) -> int:
        try:
            return run.cgroup.usage() if run.cgroup is not None else 0
        except (OSError, CgroupGone):
            return 0

    def _swapped(self, pid: int) -> int:
        """/proc/PID/status VmSwap: the task's pages with a swap entry (freed, or still in
        the swap cache)."""
        try:
            text = (self.tools.proc.root / str(pid) / "status").read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("VmSwap:"):
                return int(line.split()[1]) << 10
        return 0

    def _traced_from_outside(self, run: ChainRun) -> str:
        """Why the tree cannot be paged out where a task of it is traced by a process outside
        it (a dead run's CRIU still dumping it, a debugger attached from elsewhere): its
        tracer, not oomguard, decides when it runs. "" where none is (a tracer inside the
        tree, `strace -f job`, is stopped and continued with it)."""
        tree = set(run.tree.pids)
        for pid in run.tree.pids:
            try:
                tracer = self.tools.proc.status(pid).tracer_pid
            except ProcessGone:
                continue
            if tracer and tracer not in tree:
                return (f"process {pid} is traced by pid {tracer}, outside its tree (a dump "
                        "under way, or a debugger): its tracer holds it, not a page-out")
        return ""

    def _resident(self, pid: int) -> int:
        try:
            return self.tools.proc.status(pid).rss_bytes
        except ProcessGone:
            return 0

    def _room_on_disk(self, size: int) -> None:
        """A swap file counts against the store's budget (it lives in the store's file
        system): refused where it would take the store over it."""
        budget = self.tools.checkpointer.budget
        if budget is None:
            return
        try:
            reading = budget.reading()
        except StoreError as exc:
            raise PageoutError(str(exc)) from exc
        if not reading.fits(size):
            raise PageoutError(f"no room for a {format_size(size)} swap file within the "
                               f"store's budget ({format_size(reading.excess(size))} over)")

    def _give_back(self, made: list[str]) -> None:
        if made:
            with contextlib.suppress(PageoutError):
                self.tools.pageout.resumer().release_swap()

    def _entry(self, run: ChainRun, advised: int, made: list[str]) -> PagedOutTree:
        po, tree = self.tools.pageout, run.tree
        now = po.wall_clock()
        tasks = tuple((pid, self.tools.proc.starttime(pid)) for pid in run.frozen)
        return PagedOutTree(
            id=f"po-{tree.root.pid}-{int(now * 1000)}", root_pid=tree.root.pid, tasks=tasks,
            uid=tree.root.uid, cgroup=run.cgroup.rel_path if run.cgroup is not None else "",
            since=now, paged_bytes=advised, resident_bytes=tree.rss_bytes,
            command=tree.root.comm, swap_files=tuple(made))

    def _hold(self, run: ChainRun, tree: PagedOutTree) -> tuple[PagedOutTree, str]:
        """The tree recorded, and on cgroup v2 held by a frozen cgroup of its own (recorded
        first: a crash halfway leaves a record that names the hold). Returns the tree as
        recorded and, where it stays held by SIGSTOP, why."""
        record = self.tools.pageout.record
        cgroup = run.cgroup
        if cgroup is None or cgroup.version != 2:
            record.add(tree)
            return tree, "cgroup v1: no freezer of its own to hold it in"
        holds = self.tools.pageout.holds(cgroup.mount)
        try:
            child = holds.planned(tree.id, run.frozen)
        except HoldRefused as exc:
            record.add(tree)
            return tree, exc.reason
        held = replace(tree, hold=str(child))
        record.add(held)
        try:
            holds.hold(child, run.frozen, HOLD_WAIT)
        except HoldRefused as exc:
            record.add(tree)
            return tree, exc.reason
        return held, ""

    def _failed(self, run: ChainRun, reason: str) -> StepResult:
        then = run.then("nothing more: the tree is continued")
        self.tools.log.error("pageout.failed", reason=reason, then=then, **run.fields)
        return CONTINUE
