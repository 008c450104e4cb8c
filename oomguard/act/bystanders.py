"""Holding the other processes of a victim's memory cgroup stopped while it is dumped, so that
the room lifted for the dump is the victim's alone and nothing else of the cgroup reaches the
limit meanwhile (which processes: oomguard/policy/bystanders.py).

Recorded in the frozen ledger before the first SIGSTOP, as a victim is: a daemon that dies
while it holds them has them continued by the next start. Continued once the dump has ended
and the limit is back; one the user stopped meanwhile stays stopped. A task waiting at the
limit (parked in a page fault) takes its SIGSTOP as soon as the lift wakes it, before it can
touch the room.

Several dumps may run at once (the daemon's and one asked for on the control socket): a task
held by two is continued when the last lets go, a task that is a victim now is never held or
continued here, and a held task chosen as a victim meanwhile is stopped by oomguard, not by
its user (`held_now`, for the freeze)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from oomguard.cgroup.base import MemoryCgroup, subtree_procs
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.policy.bystanders import LEFT_ALONE_STATES, Bystander, to_hold
from oomguard.sense.procfs import ProcReader
from oomguard.sense.selfguard import ancestry, own_family
from oomguard.store.ledger import FrozenLedger


@dataclass
class Held:
    """The bystanders one dump stopped (to be continued), and the cgroup they are in."""

    cgroup: str = ""
    pids: list[int] = field(default_factory=list)


USER_STOPPED_STATE = "T"
ARRIVAL_POLL = 0.01  # s between reads of a cgroup's tasks while a dump holds its others


class Bystanders:
    """Light on imports (the standby, oomguard/daemon/standby.py, holds cgroups with it)."""

    def __init__(self, proc: ProcReader, ledger: FrozenLedger,
                 kill: Callable[[int, int], None] = os.kill,
                 self_pid: int | None = None) -> None:
        self.proc = proc
        self.ledger = ledger
        self.kill = kill
        self.self_pid = os.getpid() if self_pid is None else self_pid
        self._lock = threading.Lock()
        self._holds: Counter[int] = Counter()  # pid -> dumps holding it
        self._victims: Counter[int] = Counter()  # pid -> dumps it is the victim of
        # Held (by id) -> the watch of what comes into its cgroup (follow), and its stop.
        self._follows: dict[int, tuple[threading.Event, threading.Thread]] = {}

    @contextlib.contextmanager
    def victim(self, pids: Collection[int]) -> Iterator[None]:
        """While a tree is being checkpointed: never held or continued as a bystander."""
        with self._lock:
            self._victims.update(pids)
        try:
            yield
        finally:
            with self._lock:
                self._victims.subtract(pids)
                self._victims += Counter()  # drops the zeros

    def held_now(self, pids: Collection[int]) -> list[int]:
        """Those of `pids` that a dump holds stopped now (stopped by oomguard, not the user)."""
        with self._lock:
            return [pid for pid in pids if self._holds[pid] > 0]

    def hold(self, cgroup: MemoryCgroup, victim: Collection[int],
             requester: int | None = None, skip: Collection[int] = ()) -> Held:
        """Stop every other process of `cgroup` (and the cgroups beneath it) but the victim's
        tree (its pids, the root first) and `skip`; returns what was stopped. Raises nothing:
        a cgroup or a process that went away, an unwritable ledger or a task that may not be
        signalled holds less (the dump goes on as it would have without this)."""
        held = Held(str(cgroup.path))
        try:
            pids = subtree_procs(cgroup.path)
        except (CgroupGone, OSError):
            return held
        found = []
        for pid in pids:
            if pid in victim or pid in skip:
                continue
            try:
                stat = self.proc.stat(pid)
                if self._restoring(stat.ppid):
                    continue  # a task CRIU is restoring (a restore into this cgroup under way)
                # Traced: a CRIU at work on it (its parasite runs in it: not state t).
                traced = stat.state not in LEFT_ALONE_STATES \
                    and self.proc.status(pid).tracer_pid != 0
            except (ProcessGone, ValueError, IndexError):
                continue
            found.append(Bystander(pid, stat.ppid, stat.state, traced))
        if not found:
            return held
        spared = set(own_family(self.proc, self.self_pid))
        if requester:
            spared.update(ancestry(self.proc, requester))
        with self._lock:
            spared.update(self._victims)
            chosen = to_hold(found, victim, spared)
            # Stopped by another dump already (state T, so not chosen): counted, not signalled
            # again (a second stop would stay pending and read as the user's).
            shared = [b.pid for b in found if self._holds[b.pid] > 0 and b.pid not in spared]
            if chosen:
                try:
                    # Before the SIGSTOP: a crash continues them (once the victim's dump ended).
                    self.ledger.record(chosen, waits_for=next(iter(victim), 0))
                except OSError:
                    chosen = []
            for pid in chosen:
                with contextlib.suppress(OSError):  # gone, or not ours to stop (EPERM)
                    self.kill(pid, signal.SIGSTOP)
                    held.pids.append(pid)
            held.pids += shared
            self._holds.update(held.pids)
        missed = [pid for pid in chosen if pid not in held.pids]
        if missed:
            with contextlib.suppress(OSError):
                self.ledger.clear(missed)
        return held

    def follow(self, cgroup: MemoryCgroup, victim: Collection[int], requester: int | None,
               held: Held, interval: float = ARRIVAL_POLL) -> None:
        """Until release(held), hold too what comes into the cgroup: a job started there while
        the victim is dumped (a scheduler's, a user's at a prompt) takes the room lifted for
        the dump, and the limit cannot come back (in the soak, a job started 0.1 s into its
        mate's dump grew to 179 MiB in a 192 MiB cgroup, the dump failed and its victim was
        killed to put the limit back). cgroup.procs is read every `interval` in a thread."""
        try:
            seen = set(subtree_procs(cgroup.path)) | set(victim)
        except (CgroupGone, OSError):
            return
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(interval):
                try:
                    now = subtree_procs(cgroup.path)
                except (CgroupGone, OSError):
                    return
                if all(pid in seen for pid in now):
                    continue
                more = self.hold(cgroup, victim, requester, skip=seen)
                seen.update(now)
                with self._lock:
                    held.pids += more.pids
        thread = threading.Thread(target=watch, name="oomguard-arrivals", daemon=True)
        with self._lock:
            self._follows[id(held)] = (stop, thread)
        thread.start()

    def _unfollow(self, held: Held) -> None:
        with self._lock:
            following = self._follows.pop(id(held), None)
        if following is not None:
            stop, thread = following
            stop.set()
            thread.join()

    def _restoring(self, ppid: int) -> bool:
        try:
            return ppid > 1 and self.proc.stat(ppid).comm == "criu"
        except (ProcessGone, ValueError, IndexError):
            return False

    def release(self, held: Held) -> None:
        """Continue what `hold` stopped (and `follow` since): not a task another dump still
        holds or is dumping, nor one someone else stopped meanwhile."""
        self._unfollow(held)
        if not held.pids:
            return
        with self._lock:
            self._holds.subtract(held.pids)
            free = [pid for pid in dict.fromkeys(held.pids)
                    if self._holds[pid] <= 0 and not self._victims[pid]]
            self._holds += Counter()
            for pid in free:
                if not self._stopped_again(pid):
                    with contextlib.suppress(OSError):
                        self.kill(pid, signal.SIGCONT)
            with contextlib.suppress(OSError):
                self.ledger.clear(free)
        held.pids = []

    def _stopped_again(self, pid: int) -> bool:
        """Stopped by someone else too while held: a stop signal sent to a stopped task stays
        pending (as act.freezer's stopped_again)."""
        try:
            return (self.proc.state(pid) == USER_STOPPED_STATE
                    and self.proc.status(pid).stop_pending)
        except (ProcessGone, ValueError):
            return False
