"""The exact freeze (oomguard.act.forkfollow.ForkFollow) against a fake /proc in kernel format and
fake process events: a SIGSTOP takes effect at the next tick of the injected sleep, and a
task may fork on its way to the stop (a fork that has passed copy_process's signal check).
The same world through the /proc re-listing shows what that path lets escape."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from oomguard.act.forkfollow import ForkFollow
from oomguard.act.freezer import SigstopFreezer
from oomguard.act.frozen import BY_EVENTS, BY_LISTING
from oomguard.model.errors import ProcessGone
from oomguard.sense.cnproc import ProcessEvent, ProcessExec, ProcessExit, ProcessFork
from oomguard.sense.procevents import EventBatch, EventSource, Subscriber
from oomguard.sense.procfs import ProcReader
from tests.unit._support import stat_line

ROOT, KID, GRANDKID, GREAT = 4_000_100, 4_000_101, 4_000_102, 4_000_103  # above any real pid


@dataclass
class Task:
    ppid: int
    threads: dict[int, str]  # tid -> state
    on_stop: list[int] = field(default_factory=list)  # children forked on the way to the stop
    exits_on_stop: bool = False  # exits instead of stopping (after its forks)
    stuck: int = 0  # ticks it stays in D before a SIGSTOP can take it
    lag: int = 0  # ticks its other threads run on after the main one has stopped
    starttime: int = 1000  # clock ticks since boot: with the pid, names the process


class World:
    """Processes as /proc files under `root`, the events a kernel would send, and signals."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tasks: dict[int, Task] = {}
        self.plans: dict[int, list[int]] = {}  # pid -> what it forks on its way, once it exists
        self.queue: list[ProcessEvent] = []
        self.stopping: set[int] = set()  # SIGSTOP sent, not taken yet
        self.signals: list[tuple[int, int]] = []
        self.drop_events = False  # the socket overflows: events vanish, read() says lost
        self.lost = 0
        self.closed = 0
        self.opened = 0
        self.ticks = 0
        self.now = 0.0
        root.mkdir(parents=True, exist_ok=True)

    # -- the kernel's side --------------------------------------------------------------------

    def add(self, pid: int, ppid: int, state: str = "S", *, threads: dict[int, str] | None = None,
            on_stop: list[int] | None = None, exits_on_stop: bool = False, stuck: int = 0,
            ) -> None:
        self.tasks[pid] = Task(ppid, threads or {pid: state}, on_stop or self.plans.get(pid, []),
                               exits_on_stop, stuck)
        if ppid in self.tasks:
            self.write(ppid)
        self.write(pid)

    def fork(self, parent: int, child: int, tid: int | None = None) -> None:
        self.add(child, parent)
        self.event(ProcessFork(tid or parent, parent, child, child, self.ticks))

    def event(self, event: ProcessEvent) -> None:
        if self.drop_events:
            self.lost += 1
        else:
            self.queue.append(event)

    def exit(self, pid: int) -> None:
        task = self.tasks.pop(pid)
        for kid, other in self.tasks.items():
            if other.ppid == pid:
                other.ppid = 1  # reparented to init: out of the tree
                self.write(kid)
        if task.ppid in self.tasks:
            self.write(task.ppid)
        for path in sorted((self.root / str(pid)).rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (self.root / str(pid)).rmdir()
        self.event(ProcessExit(pid, pid, 0, self.ticks))

    def state(self, pid: int) -> str:
        return self.tasks[pid].threads[pid] if pid in self.tasks else "gone"

    def write(self, pid: int) -> None:
        task = self.tasks[pid]
        base = self.root / str(pid)
        kids = [k for k, t in self.tasks.items() if t.ppid == pid]
        for tid, state in task.threads.items():
            (base / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
            (base / "task" / str(tid) / "stat").write_text(
                stat_line(tid, "job", state, task.ppid, starttime=task.starttime))
            # children are listed under the thread that forked them: the main one here
            (base / "task" / str(tid) / "children").write_text(
                "".join(f"{k} " for k in kids) if tid == pid else "")
        (base / "stat").write_text(stat_line(pid, "job", task.threads[pid], task.ppid,
                                             starttime=task.starttime))

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.tasks:
            raise ProcessLookupError(pid)
        self.signals.append((pid, sig))
        task = self.tasks[pid]
        if sig == signal.SIGSTOP and task.threads[pid] != "T":
            self.stopping.add(pid)
        elif sig == signal.SIGCONT:
            self.stopping.discard(pid)
            task.threads = dict.fromkeys(task.threads, "S")
            self.write(pid)

    def sleep(self, seconds: float) -> None:
        """One tick: every task a SIGSTOP was sent to forks what it forks on the way, then
        stops (or exits), unless stuck in D a while longer."""
        self.ticks += 1
        self.now += seconds
        for pid in sorted(self.stopping):
            task = self.tasks.get(pid)
            if task is None:
                self.stopping.discard(pid)
                continue
            if task.stuck:
                task.stuck -= 1
                task.threads = dict.fromkeys(task.threads, "D")
                self.write(pid)
                continue
            if task.lag:
                task.lag -= 1
                task.threads[pid] = "T"  # the main thread has stopped; the others run on
                self.write(pid)
                continue
            for child in task.on_stop:
                self.fork(pid, child)
            task.on_stop = []
            self.stopping.discard(pid)
            if task.exits_on_stop:
                self.exit(pid)
            else:
                task.threads = dict.fromkeys(task.threads, "T")
                self.write(pid)

    # -- the event source's side --------------------------------------------------------------

    def open(self) -> EventSource:
        self.opened += 1
        return self  # type: ignore[return-value]

    def fileno(self) -> int:
        return -1

    def read(self) -> EventBatch:
        events, self.queue = tuple(self.queue), []
        lost, self.lost = self.lost, 0
        return EventBatch(events, lost)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path / "proc")


def freezer(world: World, *, connector: bool = True) -> SigstopFreezer:
    def unavailable() -> EventSource:
        raise PermissionError(1, "Operation not permitted")

    events = Subscriber(world.open if connector else unavailable)
    return SigstopFreezer(ProcReader(world.root), sleep=world.sleep, clock=lambda: world.now,
                          events=events, kill=world.kill)


def stops(world: World) -> list[int]:
    return [pid for pid, sig in world.signals if sig == signal.SIGSTOP]


def test_forks_racing_the_freeze_are_stopped_at_once(world: World) -> None:
    """The child forks a grandchild on its way to the stop; the grandchild, stopped from its
    fork event, forks in turn before it stops: all four end stopped, each SIGSTOPped once.
    Forks, execs and exits elsewhere on the machine are not taken."""
    world.add(ROOT, 1)
    world.add(KID, ROOT, on_stop=[GRANDKID])
    world.plans[GRANDKID] = [GREAT]
    other = ROOT - 50
    world.add(other, 1, on_stop=[other + 1])
    free = freezer(world)
    frozen = free.freeze(ROOT)
    assert frozen.method == BY_EVENTS and frozen.stopped is None and frozen.follow is not None
    assert frozen.pids == [ROOT, KID] and world.opened == 1
    world.kill(other, signal.SIGSTOP)  # someone else's stop: it forks on its way too
    world.event(ProcessExec(other, other))
    done = free.wait_frozen(frozen, 5.0)
    assert done.pids == [ROOT, KID, GRANDKID, GREAT]
    assert sorted(stops(world)) == [other, ROOT, KID, GRANDKID, GREAT]
    assert all(world.state(pid) == "T" for pid in done.pids)
    assert world.state(other + 1) == "S"
    assert (done.stopped, done.caught, done.left, done.user_stopped) == (True, 2, [], [])
    assert world.closed == 1 and done.follow is None
    assert done.fields() == {"freeze": "connector", "forks_caught": 2}


def test_forks_queued_before_the_freezer_reads_are_all_caught(world: World) -> None:
    """Several generations forked before the socket is read: taken in the kernel's order."""
    world.add(ROOT, 1)
    free = freezer(world)
    frozen = free.freeze(ROOT)
    world.fork(ROOT, KID)
    world.fork(KID, GRANDKID)
    world.fork(GRANDKID, GREAT)
    done = free.wait_frozen(frozen, 5.0)
    assert done.pids == [ROOT, KID, GRANDKID, GREAT] and done.caught == 3 and done.stopped
    assert all(world.state(pid) == "T" for pid in done.pids)


def test_the_same_race_escapes_the_relisting(world: World) -> None:
    """Without the connector: the tree is re-listed before the child's fork, which then
    escapes (the hole the connector closes)."""
    world.add(ROOT, 1)
    world.add(KID, ROOT, on_stop=[GRANDKID])
    free = freezer(world, connector=False)
    frozen = free.freeze(ROOT)
    assert frozen.method == BY_LISTING
    assert frozen.why_listing == "EPERM: no CAP_NET_ADMIN"
    done = free.wait_frozen(frozen, 5.0)
    assert done.pids == [ROOT, KID] and done.stopped
    assert world.state(GRANDKID) == "S"  # forked on the way, never stopped
    assert done.fields() == {"freeze": "proc", "freeze_fallback": "EPERM: no CAP_NET_ADMIN"}


def test_the_users_stopped_tasks_get_no_sigstop(world: World) -> None:
    world.add(ROOT, 1, on_stop=[GREAT])
    world.add(KID, ROOT, "T")  # the user's (Ctrl-Z)
    world.add(GRANDKID, ROOT, "T")  # stopped by a chain's freeze step: held
    free = freezer(world)
    frozen = free.freeze(ROOT, held=[GRANDKID])
    world.tasks[ROOT].on_stop = []
    world.add(GREAT, ROOT, "T")  # forked and stopped by someone before oomguard looked
    world.event(ProcessFork(ROOT, ROOT, GREAT, GREAT))
    done = free.wait_frozen(frozen, 5.0)
    assert sorted(done.pids) == [ROOT, KID, GRANDKID, GREAT]
    assert sorted(done.user_stopped) == [KID, GREAT]
    assert sorted(done.ours) == [ROOT, GRANDKID]
    # The held one is stopped already: a second SIGSTOP would stay pending (the user's mark).
    assert sorted(stops(world)) == [ROOT]


def test_a_thread_still_running_may_fork_and_is_waited_for(world: World) -> None:
    """Group stop: the main thread stops first, another is on its way out of a fork; the
    process counts as stopped only once every thread is."""
    tid = ROOT + 50
    world.add(ROOT, 1, threads={ROOT: "S", tid: "R"}, on_stop=[KID])
    world.tasks[ROOT].lag = 2
    free = freezer(world)
    done = free.wait_frozen(free.freeze(ROOT), 5.0)
    assert done.pids == [ROOT, KID] and done.caught == 1 and world.state(KID) == "T"
    assert world.tasks[ROOT].threads == {ROOT: "T", tid: "T"}


def test_a_task_stuck_in_d_is_waited_for_then_times_out(world: World) -> None:
    world.add(ROOT, 1)
    world.add(KID, ROOT, stuck=3, on_stop=[GRANDKID])  # at the limit, then forks on its way
    free = freezer(world)
    done = free.wait_frozen(free.freeze(ROOT), 5.0)
    assert done.stopped and done.pids == [ROOT, KID, GRANDKID]
    stuck = World(world.root.parent / "stuck")
    stuck.add(ROOT, 1, stuck=10**6)
    free = freezer(stuck)
    late = free.wait_frozen(free.freeze(ROOT), 0.05)
    assert late.stopped is False and late.pids == [ROOT] and stuck.closed == 1


def test_lost_events_walk_proc_again(world: World) -> None:
    world.add(ROOT, 1, on_stop=[KID])
    free = freezer(world)
    frozen = free.freeze(ROOT)
    world.drop_events = True  # KID's fork event is lost (ENOBUFS)
    done = free.wait_frozen(frozen, 5.0)
    assert done.pids == [ROOT, KID] and world.state(KID) == "T"
    assert (done.caught, done.events_lost) == (0, 1)
    assert done.fields()["events_lost"] == 1


def test_a_child_reparented_out_of_the_tree_is_let_go(world: World) -> None:
    """The child forks and exits before it can be stopped: the grandchild, stopped from its
    event, now belongs to init; CRIU cannot dump it with the tree, so it is continued."""
    world.add(ROOT, 1)
    world.add(KID, ROOT, on_stop=[GRANDKID], exits_on_stop=True)
    free = freezer(world)
    done = free.wait_frozen(free.freeze(ROOT), 5.0)
    assert done.pids == [ROOT] and done.left == [GRANDKID]
    assert (GRANDKID, signal.SIGCONT) in world.signals and world.state(GRANDKID) == "S"
    assert done.fields()["left_tree"] == [GRANDKID]


def test_a_pid_taken_by_another_process_is_neither_waited_for_nor_continued(
        world: World) -> None:
    """A task of the tree ends and its pid goes to an unrelated process (another start
    time): that one is not the tree's to wait for, nor to continue."""
    world.add(ROOT, 1)
    world.add(KID, 1)  # reparented out of the tree already
    follow = ForkFollow(ROOT, world, ProcReader(world.root), kill=world.kill)
    follow.walk()
    follow.take(KID)  # as if its fork event had named ROOT
    world.sleep(0)
    world.tasks[KID] = Task(1, {KID: "R"}, starttime=2000)  # a new process with that pid
    world.write(KID)
    assert follow.unsettled() == []
    assert follow.reconcile() == 0 and follow.left == []
    assert (KID, signal.SIGCONT) not in world.signals


def test_thread_creation_and_forks_elsewhere_are_not_taken(world: World) -> None:
    world.add(ROOT, 1)
    world.add(KID, 1)  # not in the tree
    free = freezer(world)
    frozen = free.freeze(ROOT)
    world.event(ProcessFork(ROOT, ROOT, ROOT + 1, ROOT))  # a new thread of ROOT
    world.fork(KID, GRANDKID)  # outside the tree
    done = free.wait_frozen(frozen, 5.0)
    assert done.pids == [ROOT] and stops(world) == [ROOT]


def test_a_root_gone_raises_and_closes_the_subscription(world: World) -> None:
    free = freezer(world)
    with pytest.raises(ProcessGone):
        free.freeze(ROOT)
    assert (world.opened, world.closed) == (1, 1)


def test_the_production_default_uses_the_real_connector_here() -> None:
    """On this machine (root, initial namespaces) the freeze takes the event path."""
    real = SigstopFreezer()
    probe = real.events.probe()
    if probe is not None:
        pytest.skip(f"process-event connector unavailable here: {probe}")
    pid = os.fork()
    if pid == 0:
        os.setsid()
        signal.pause()
        os._exit(0)
    try:
        frozen = real.freeze(pid)
        done = real.wait_frozen(frozen, 10.0)
        assert (done.method, done.stopped, done.pids) == (BY_EVENTS, True, [pid])
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
