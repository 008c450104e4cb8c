"""One freeze on the kernel's process-event connector (oomguard.sense.procevents): the
freeze subscribes before its first SIGSTOP, and every child whose fork event names a parent in
the tree is stopped at once. It is exact: a stopped task cannot fork, and a fork's event is
queued before the parent returns to user space (where its pending SIGSTOP takes it; a fork
that has not reached the end of copy_process by then is undone and restarted after the stop).
So once every thread of every task in the set is seen stopped, one last read of the socket and
one walk of the stopped tree in /proc find nothing new."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Collection

from oomguard.act.frozen import (
    BY_EVENTS,
    STOPPED_STATES,
    USER_STOPPED_STATE,
    BeforeStop,
    Frozen,
    Kill,
    continued,
    not_held,
    note_before_stop,
    send_signal,
)
from oomguard.model.errors import ProcessGone
from oomguard.sense.cnproc import ProcessFork
from oomguard.sense.procevents import EventSource
from oomguard.sense.procfs import ProcReader


class ForkFollow:
    """One freeze on the connector: the tree's tasks as found by a walk of /proc and by fork
    events, each stopped as it is found (or noted as the user's)."""

    def __init__(self, root: int, events: EventSource, proc: ProcReader,
                 held: Collection[int] = (), kill: Kill = os.kill,
                 before_stop: BeforeStop | None = None) -> None:
        self.root = root
        self.kill = kill
        self.before_stop = before_stop
        self.events = events
        self.proc = proc
        self.held = frozenset(held)
        self.members: dict[int, int] = {}  # pid -> start time, in the order found (parents
        # before children); with the pid, the start time names one process (pids are reused)
        self.user_stopped: list[int] = []
        self.settled: set[int] = set()  # seen stopped in every thread, or gone, or continued
        self.not_held: list[dict[str, object]] = []  # continued by another process
        self.caught = 0
        self.lost = 0
        self.left: list[int] = []
        self.tree: list[int] | None = None  # the stopped tree, as the final walk saw it

    def take(self, pid: int) -> None:
        """A new task of the tree: the user's if found stopped (and not `held`), else
        SIGSTOPped."""
        self.members[pid] = 0
        try:
            stat = self.proc.stat(pid)
        except ProcessGone:
            self.settled.add(pid)
            return
        self.members[pid] = stat.starttime
        if stat.state == USER_STOPPED_STATE:
            # Held: stopped by oomguard already. No second SIGSTOP: it would stay pending in
            # the stopped task and read as the user's (stopped_again).
            if pid not in self.held:
                self.user_stopped.append(pid)
            return
        note_before_stop(self.before_stop, pid)
        if not send_signal(pid, signal.SIGSTOP, self.kill):
            self.settled.add(pid)

    def walk(self) -> tuple[int, list[int]]:
        """The root's tree in /proc now, each task stopped before its children are listed;
        returns how many were new and the tree, parents first."""
        new, tree, index = 0, [self.root], 0
        seen = {self.root}
        while index < len(tree):
            pid = tree[index]
            index += 1
            if pid not in self.members:
                self.take(pid)
                new += 1
            for kid in self.proc.children_of(pid):
                if kid not in seen:
                    seen.add(kid)
                    tree.append(kid)
        return new, tree

    def drain(self) -> int:
        """Every event queued: a new process whose parent is in the tree is stopped at once.
        (Exit events are not trusted to end a task: a group leader may exit before its other
        threads; /proc says when the whole process has.) After lost events, /proc is walked
        again. Returns how many tasks were new."""
        batch = self.events.read()
        new = 0
        for event in batch.events:
            if (isinstance(event, ProcessFork) and event.new_process
                    and event.parent_tgid in self.members
                    and event.child_tgid not in self.members):
                self.take(event.child_tgid)
                self.caught += 1
                new += 1
        if batch.lost:
            self.lost += batch.lost
            new += self.walk()[0]
        return new

    def unsettled(self) -> list[int]:
        """Tasks not yet seen stopped (in every thread) or gone."""
        waiting = []
        for pid in self.members:
            if pid in self.settled:
                continue
            try:
                states = self.proc.thread_states(pid)
            except ProcessGone:
                states = []
            if all(state in STOPPED_STATES for state in states) or not self._same(pid):
                self.settled.add(pid)  # stopped, or gone (its pid taken by another process)
            elif continued(self.proc, pid):
                self.settled.add(pid)  # never held: waiting for it would wait out the timeout
                self.not_held.append(not_held(self.proc, pid, self.members))
            else:
                waiting.append(pid)
        return waiting

    def _same(self, pid: int) -> bool:
        return self.proc.starttime(pid) == self.members[pid] != 0

    def reconcile(self) -> int:
        """Walk the stopped tree: a task no event named is stopped (returns how many), and
        a task that left the tree (reparented out of it) is let go: continued, unless the
        user's."""
        new, tree = self.walk()
        inside = set(tree)
        self.tree = [pid for pid in tree if self.proc.exists(pid)]
        for pid in self.members:
            if pid not in inside and pid not in self.left and self._same(pid):
                self.left.append(pid)
                if pid not in self.user_stopped:
                    send_signal(pid, signal.SIGCONT, self.kill)
        return new

    def frozen(self, stopped: bool | None = None) -> Frozen:
        pids = self.tree if self.tree is not None else list(self.members)
        kept = set(pids)
        return Frozen(list(pids), [p for p in self.user_stopped if p in kept], BY_EVENTS,
                      caught=self.caught, left=list(self.left), events_lost=self.lost,
                      stopped=stopped, follow=None if stopped is not None else self,
                      not_held=list(self.not_held))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.events.close()
