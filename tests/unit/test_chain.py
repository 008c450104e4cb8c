"""oomguard.respond.chain: ChainRunner.run against injected fakes and an injected clock.

No real CRIU and no real freezing. Steps that call os.kill on the victim (signal, kill) run
against a real child process started here (`sleep 60`), and their real effect is asserted.
Fake PIDs are above the kernel's largest pid_max (2**22), so no signal can ever reach a real
process through them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.frozen import Frozen
from oomguard.config.actions import CHECKPOINT, KILL, Step, parse_step
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint, ProcessGone
from oomguard.policy.victims import ProcessTree
from oomguard.respond.chain import ChainOutcome, ChainRunner, ChainSettings
from oomguard.sense.procfs import ProcReader
from tests.unit._support import MiB, proc_info

PID_MAX_LIMIT = 1 << 22  # the largest pid_max Linux allows
ROOT = PID_MAX_LIMIT + 101
CHILD = PID_MAX_LIMIT + 102
EXTRA = PID_MAX_LIMIT + 103  # a descendant the freezer finds that the tree does not list
REASON = "usage 950MiB >= 85% of 1GiB"
FIELDS = {"cgroup": "/jobs/a", "pid": ROOT}
SETTINGS = ChainSettings(freeze_deadline=60.0, kill_grace=5.0, store_margin=256 * MiB,
                         headroom=64 * MiB)
T0 = 1000.0


class Sentinel:
    """Stands in for a CheckpointResult: the chain only passes it through."""


RESULT = Sentinel()


# -- fakes ---------------------------------------------------------------------------------------

class FakeClock:
    """clock() and sleep(); sleep advances the clock. `real_nap` also naps for real (capped), for
    tests that wait on a real child process."""

    def __init__(self, now: float = T0, real_nap: float = 0.0) -> None:
        self.now = now
        self.real_nap = real_nap
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.real_nap:
            time.sleep(min(seconds, self.real_nap))


class FakeFreezer:
    def __init__(self, pids: list[int] | None = None, *, gone: bool = False,
                 events: list[tuple[str, Any]] | None = None,
                 user_stopped: Collection[int] = (), again: Collection[int] = (),
                 caught: Collection[int] = ()) -> None:
        self.pids = pids  # what freeze() returns; None: the root alone
        self.caught = list(caught)  # forked meanwhile: wait_frozen() adds them
        self.user_stopped = user_stopped  # found stopped by freeze() (unless held)
        self.again = again  # stopped_again() names these
        self.held: list[list[int]] = []  # `held` passed to each freeze()
        self.gone = gone
        self.froze: list[int] = []  # root pids passed to freeze()
        self.frozen: list[int] = []  # pids freeze() returned
        self.waited: list[tuple[list[int], float]] = []
        self.thawed: list[list[int]] = []
        self.events = events if events is not None else []

    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen:
        self.froze.append(root_pid)
        self.held.append(list(held))
        self.events.append(("freeze", root_pid))
        if self.gone:
            raise ProcessGone(f"process {root_pid} is gone")
        pids = list(self.pids) if self.pids is not None else [root_pid]
        self.frozen.extend(pids)
        return Frozen(pids, [p for p in self.user_stopped if p in pids and p not in held])

    def wait_frozen(self, frozen: Frozen, timeout: float) -> Frozen:
        self.waited.append((list(frozen.pids), timeout))
        self.frozen.extend(self.caught)
        return replace(frozen, pids=frozen.pids + self.caught, stopped=True,
                       caught=len(self.caught))

    def stopped_again(self, pids: list[int]) -> list[int]:
        return [pid for pid in pids if pid in self.again]

    def thaw(self, pids: list[int]) -> None:
        self.thawed.append(list(pids))
        self.events.append(("thaw", list(pids)))

    @property
    def thawed_pids(self) -> set[int]:
        return {pid for call in self.thawed for pid in call}


class StoppingFreezer(FakeFreezer):
    """Records like FakeFreezer and really stops (SIGSTOP) / continues (SIGCONT) the PIDs it is
    given: only used with real child processes of this test."""

    def freeze(self, root_pid: int, held: Collection[int] = ()) -> Frozen:
        frozen = super().freeze(root_pid, held)
        for pid in frozen.ours:
            os.kill(pid, signal.SIGSTOP)
        return frozen

    def thaw(self, pids: list[int]) -> None:
        super().thaw(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class FakeLedger:
    def __init__(self, *, clear_error: OSError | None = None) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.clear_error = clear_error

    def record(self, pids: list[int]) -> None:
        self.calls.append(("record", list(pids)))

    def clear(self, pids: list[int]) -> None:
        self.calls.append(("clear", list(pids)))
        if self.clear_error is not None:
            raise self.clear_error

    def left_over(self, pids: list[int]) -> list[int]:  # nothing a dead run left here
        return []

    @property
    def recorded(self) -> set[int]:
        return {pid for kind, pids in self.calls if kind == "record" for pid in pids}

    @property
    def cleared(self) -> set[int]:
        return {pid for kind, pids in self.calls if kind == "clear" for pid in pids}

    def balanced(self) -> bool:
        """Every PID recorded is cleared, and the last word is a clear."""
        return (self.recorded <= self.cleared and bool(self.calls)
                and self.calls[-1][0] == "clear")


@dataclass
class FakeStore:
    root: Path

    @property
    def state(self) -> Path:  # this node's records: in the store (store/nodestate.py)
        return self.root


class FakeCheckpointer:
    """`.checkpoint()` returns RESULT, or raises `error`; `advance` moves the clock first (a
    dump that takes time)."""

    def __init__(self, store_root: Path, *, error: Exception | None = None,
                 clock: FakeClock | None = None, advance: float = 0.0,
                 ledger: FakeLedger | None = None,
                 events: list[tuple[str, Any]] | None = None) -> None:
        self.ledger = ledger or FakeLedger()
        self.store = FakeStore(store_root)
        self.error = error
        self.clock = clock
        self.advance = advance
        self.calls: list[dict[str, Any]] = []
        self.events = events if events is not None else []
        self.on_call: Callable[[dict[str, Any]], None] | None = None  # as the call begins

    def checkpoint(self, tree: ProcessTree, cgroup: Any, reason: str,
                   on_frozen: Callable[[Frozen, float], None] | None = None, *,
                   headroom: int | None = None,
                   after_signal: Callable[[], None] | None = None,
                   held: Collection[int] = ()) -> Any:
        self.calls.append({"tree": tree, "cgroup": cgroup, "reason": reason,
                           "on_frozen": on_frozen, "headroom": headroom,
                           "after_signal": after_signal,
                           "held": list(held)})
        self.events.append(("checkpoint", tree.root.pid))
        if self.on_call is not None:
            self.on_call(self.calls[-1])
        if self.clock is not None:
            self.clock.advance(self.advance)
        if self.error is not None:
            raise self.error
        return RESULT


class FakeProc:
    """exists()/state() from a table; a PID not in it is gone (state raises ProcessGone)."""

    def __init__(self, states: dict[int, str] | None = None, cgroup: str = "/jobs/a") -> None:
        self.states = dict(states or {})
        self.cgroup = cgroup

    def exists(self, pid: int) -> bool:
        return pid in self.states

    def memory_cgroup(self, pid: int) -> str:
        return self.cgroup

    def state(self, pid: int) -> str:
        try:
            return self.states[pid]
        except KeyError:
            raise ProcessGone(f"process {pid} is gone") from None


class RacingProc:
    """/proc/PID is still there when exists() looks, gone by the time state() reads it."""

    def memory_cgroup(self, pid: int) -> str:
        return "/jobs/a"

    def exists(self, pid: int) -> bool:
        return True

    def state(self, pid: int) -> str:
        raise ProcessGone(f"process {pid} is gone")


class LogRecorder:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def _add(self, level: str, event: str, **fields: Any) -> None:
        self.records.append((level, event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self._add("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._add("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._add("error", event, **fields)

    @property
    def events(self) -> list[str]:
        return [event for _, event, _ in self.records]

    def find(self, event: str) -> tuple[str, dict[str, Any]]:
        [(level, fields)] = [(lv, f) for lv, ev, f in self.records if ev == event]
        return level, fields


class Pressure:
    """still_pressing(): answers from a script, then `then` forever; counts calls."""

    def __init__(self, answers: tuple[bool, ...] = (), then: bool = True,
                 hook: Callable[[], None] | None = None) -> None:
        self.answers = list(answers)
        self.then = then
        self.hook = hook
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.hook is not None:
            self.hook()
        return self.answers.pop(0) if self.answers else self.then


def make_tree(root: int = ROOT, *children: int, rss_mib: float = 100) -> ProcessTree:
    members = [proc_info(root, rss_mib=rss_mib)]
    members += [proc_info(pid, ppid=root, rss_mib=rss_mib) for pid in children]
    return ProcessTree(root=members[0], members=tuple(members))


def chain(*texts: str) -> tuple[Step, ...]:
    return tuple(parse_step(t) for t in texts)


@dataclass
class Rig:
    runner: ChainRunner
    clock: FakeClock
    freezer: FakeFreezer
    checkpointer: FakeCheckpointer
    ledger: FakeLedger
    log: LogRecorder
    free_calls: list[Path] = field(default_factory=list)
    events: list[tuple[str, Any]] = field(default_factory=list)


def make_rig(tmp_path: Path, *, free: int = 1 << 40, error: Exception | None = None,
             dump_s: float = 0.0, freezer: FakeFreezer | None = None,
             proc: Any = None, real_nap: float = 0.0,
             ledger: FakeLedger | None = None) -> Rig:
    clock = FakeClock(real_nap=real_nap)
    events: list[tuple[str, Any]] = []
    freezer = freezer or FakeFreezer()
    freezer.events = events
    ledger = ledger or FakeLedger()
    checkpointer = FakeCheckpointer(tmp_path / "store", error=error, clock=clock, advance=dump_s,
                                    ledger=ledger, events=events)
    log = LogRecorder()
    free_calls: list[Path] = []

    def free_space(path: Path) -> int:
        free_calls.append(path)
        return free

    runner = ChainRunner(checkpointer, freezer, proc if proc is not None else FakeProc(),  # type: ignore[arg-type]
                         log, clock=clock, sleep=clock.sleep, free=free_space)
    return Rig(runner, clock, freezer, checkpointer, ledger, log, free_calls, events)


def run(rig: Rig, steps: tuple[Step, ...], tree: ProcessTree, *,
        settings: ChainSettings = SETTINGS, pressing: Callable[[], bool] | None = None,
        on_frozen: Callable[[Frozen, float], None] | None = None,
        after_signal: Callable[[], None] | None = None) -> ChainOutcome:
    return rig.runner.run(steps, tree, None, REASON, settings, pressing or Pressure(),
                          dict(FIELDS), on_frozen=on_frozen, after_signal=after_signal)


def left_frozen(rig: Rig) -> set[int]:
    """PIDs the chain's own freeze stopped that nobody released: not thawed by the chain, and not
    handed to a checkpoint that dumped or thawed them."""
    released = set(rig.freezer.thawed_pids)
    if rig.checkpointer.calls and (rig.checkpointer.error is None or (
            isinstance(rig.checkpointer.error, CheckpointFailed)
            and rig.checkpointer.error.outcome != "untouched")):
        released |= set(rig.freezer.frozen)  # the checkpoint dumped them, or thawed them
    return set(rig.freezer.frozen) - released


# -- the table: chains that never signal the victim ---------------------------------------------

# free space 1 MiB short of what the table's 100 MiB tree needs (rss + store_margin)
SHORT = 100 * MiB + SETTINGS.store_margin - MiB


@dataclass(frozen=True)
class Case:
    id: str
    steps: tuple[str, ...]
    result: str
    step: str
    detail: str
    error: Exception | None = None
    free: int = 1 << 40
    freeze_gone: bool = False
    pressing: tuple[bool, ...] = ()
    dump_s: float = 0.0
    stall_after_freeze: float = 0.0  # how long the freeze takes to report (on_frozen)
    settings: ChainSettings = SETTINGS
    checkpoint_calls: int = 0
    froze: bool = False
    thawed_by_chain: bool = False
    logs: tuple[str, ...] = ()


DEADLINE_DETAIL = "freeze deadline (60s) passed"
REFUSED_DETAIL = (f"store {{root}} has {SHORT >> 20} MiB free, a checkpoint needs "
                  f"~{(100 * MiB + SETTINGS.store_margin) >> 20} MiB")

CASES = [
    Case("checkpoint-ok", ("checkpoint",), "checkpointed", "checkpoint", REASON,
         checkpoint_calls=1),
    # the failure's message goes to the checkpoint.failed log; the chain then runs out of steps
    Case("checkpoint-fails-thawed", ("checkpoint",), "thawed", "checkpoint",
         "no action settled it",
         error=CheckpointFailed("criu said no", "thawed"), checkpoint_calls=1,
         logs=("checkpoint.failed",)),
    Case("checkpoint-untouched", ("checkpoint",), "thawed", "checkpoint", "no action settled it",
         error=CheckpointFailed("store unwritable", "untouched"), checkpoint_calls=1,
         logs=("checkpoint.failed",)),
    # dumped (the tree is dead) but the commit failed: settled, the kill never runs
    Case("checkpoint-incomplete-ends-the-chain", ("checkpoint", "kill"), "incomplete",
         "checkpoint", "dumped; commit pending",
         error=CheckpointFailed("dumped; commit pending", "dumped, commit pending"),
         checkpoint_calls=1, logs=("checkpoint.failed",)),
    Case("checkpoint-gone", ("checkpoint",), "gone", "", "the victim exited",
         error=ProcessGone("process is gone"), checkpoint_calls=1),
    Case("store-refused", ("checkpoint",), "thawed", "checkpoint", "no action settled it",
         free=SHORT, logs=("checkpoint.refused",)),
    Case("store-exactly-enough", ("checkpoint",), "checkpointed", "checkpoint", REASON,
         free=SHORT + MiB, checkpoint_calls=1),
    Case("single-step-ignores-pressure", ("checkpoint",), "checkpointed", "checkpoint", REASON,
         pressing=(False,), checkpoint_calls=1),
    Case("freeze-checkpoint-ok", ("freeze", "checkpoint"), "checkpointed", "checkpoint", REASON,
         checkpoint_calls=1, froze=True),
    Case("freeze-checkpoint-fails", ("freeze", "checkpoint"), "thawed", "checkpoint",
         "no action settled it", error=CheckpointFailed("criu said no", "thawed"), checkpoint_calls=1,
         froze=True, logs=("checkpoint.failed",)),
    Case("freeze-checkpoint-untouched", ("freeze", "checkpoint"), "thawed", "checkpoint",
         "no action settled it", error=CheckpointFailed("refused", "untouched"),
         checkpoint_calls=1, froze=True, thawed_by_chain=True, logs=("checkpoint.failed",)),
    Case("freeze-store-refused", ("freeze", "checkpoint"), "thawed", "checkpoint",
         "no action settled it", free=SHORT, froze=True, thawed_by_chain=True,
         logs=("checkpoint.refused",)),
    Case("freeze-pressure-passes", ("freeze", "checkpoint"), "stood-down", "checkpoint",
         "the pressure passed", pressing=(False,), froze=True, thawed_by_chain=True),
    Case("freeze-pressure-passes-before-kill", ("freeze", "checkpoint", "kill"), "stood-down",
         "kill", "the pressure passed", pressing=(True, False), free=SHORT, froze=True,
         thawed_by_chain=True, logs=("checkpoint.refused",)),
    Case("freeze-gone", ("freeze", "checkpoint"), "gone", "", "the victim exited",
         freeze_gone=True),
    Case("freeze-only", ("freeze",), "thawed", "freeze", "no action settled it", froze=True,
         thawed_by_chain=True),
    Case("freeze-deadline-between-steps", ("freeze", "checkpoint"), "thawed", "checkpoint",
         DEADLINE_DETAIL, stall_after_freeze=61.0, froze=True, thawed_by_chain=True),
    Case("freeze-deadline-exactly-reached", ("freeze", "checkpoint"), "checkpointed",
         "checkpoint", REASON, stall_after_freeze=60.0, checkpoint_calls=1, froze=True),
    Case("freeze-deadline-fractional", ("freeze", "checkpoint"), "thawed", "checkpoint",
         "freeze deadline (2.5s) passed", stall_after_freeze=3.0, froze=True,
         thawed_by_chain=True, settings=ChainSettings(freeze_deadline=2.5)),
    # the dump itself outlasts the deadline and is refused: the kill is not reached either
    Case("freeze-deadline-in-checkpoint", ("freeze", "checkpoint", "kill"), "thawed", "kill",
         DEADLINE_DETAIL, error=CheckpointFailed("refused", "untouched"), dump_s=61.0,
         checkpoint_calls=1, froze=True, thawed_by_chain=True, logs=("checkpoint.failed",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_chain_table(tmp_path: Path, case: Case) -> None:
    tree = make_tree(ROOT, CHILD, rss_mib=50)  # 100 MiB in all
    rig = make_rig(tmp_path, free=case.free, error=case.error, dump_s=case.dump_s,
                   freezer=FakeFreezer(gone=case.freeze_gone))
    pressing = Pressure(case.pressing)
    frozen_calls: list[tuple[list[int], float]] = []

    def on_frozen(frozen: Frozen, at: float) -> None:
        frozen_calls.append((frozen.pids, at))
        rig.clock.advance(case.stall_after_freeze)

    outcome = run(rig, chain(*case.steps), tree, settings=case.settings, pressing=pressing,
                  on_frozen=on_frozen)

    detail = case.detail.replace("{root}", str(tmp_path / "store"))
    assert (outcome.result, outcome.step, outcome.detail) == (case.result, case.step, detail)
    assert outcome.checkpoint is (RESULT if case.result == "checkpointed" else None)
    assert len(rig.checkpointer.calls) == case.checkpoint_calls
    assert rig.freezer.froze == ([ROOT] if case.froze or case.freeze_gone else [])
    assert bool(rig.freezer.thawed) == case.thawed_by_chain
    assert left_frozen(rig) == set()
    assert rig.ledger.balanced(), rig.ledger.calls
    assert rig.log.events == list(case.logs)
    # the pressure is re-read before every step but the first
    assert pressing.calls <= max(len(case.steps) - 1, 0)


# -- single behaviours ---------------------------------------------------------------------------

def test_checkpoint_gets_rule_settings(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    tree = make_tree(ROOT, CHILD)
    settings = ChainSettings(headroom=32 * MiB)
    rig.runner.run(chain("checkpoint"), tree, None, REASON, settings, Pressure(), dict(FIELDS))
    [call] = rig.checkpointer.calls
    assert call["tree"] is tree
    assert call["reason"] == REASON
    assert call["headroom"] == 32 * MiB
    assert rig.free_calls == [tmp_path / "store"]


def test_without_freeze_step_callbacks_go_to_the_checkpoint(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)

    def on_frozen(frozen: Frozen, at: float) -> None:
        pass

    def after_signal() -> None:
        pass

    run(rig, chain("checkpoint"), make_tree(), on_frozen=on_frozen, after_signal=after_signal)
    [call] = rig.checkpointer.calls
    assert call["on_frozen"] is on_frozen
    assert call["after_signal"] is after_signal


def test_freeze_step_calls_callbacks_once_then_not_the_checkpoint(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD]))
    rig.clock.now = 2000.0
    seen: list[Any] = []

    def after_signal() -> None:
        seen.append(("after_signal", list(rig.freezer.waited)))

    def on_frozen(frozen: Frozen, at: float) -> None:
        seen.append(("on_frozen", frozen.pids, at))

    outcome = run(rig, chain("freeze", "checkpoint"), make_tree(ROOT, CHILD),
                  on_frozen=on_frozen, after_signal=after_signal)
    assert outcome.result == "checkpointed"
    # after_signal runs once SIGSTOP is sent, before waiting for the tasks to stop
    assert seen == [("after_signal", []), ("on_frozen", [ROOT, CHILD], 2000.0)]
    assert rig.freezer.waited == [([ROOT, CHILD], 5.0)]
    [call] = rig.checkpointer.calls
    assert call["on_frozen"] is None and call["after_signal"] is None


@pytest.mark.parametrize("how", ["found-stopped", "stopped-again"])
def test_freeze_step_never_continues_a_task_the_user_stopped(tmp_path: Path, how: str) -> None:
    """Found stopped by the freeze, or stopped again while the chain held it: the checkpoint
    is told which tasks the chain holds (the others it finds stopped are the user's), and no
    thaw, here after a failed checkpoint, continues it; the ledger forgets it."""
    user = {"user_stopped": [CHILD]} if how == "found-stopped" else {"again": [CHILD]}
    failed = CheckpointFailed("criu dump failed", "thawed")
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD], **user), error=failed)
    outcome = run(rig, chain("freeze", "checkpoint"), make_tree(ROOT, CHILD))
    assert outcome.result == "thawed"
    [call] = rig.checkpointer.calls
    assert call["held"] == [ROOT]
    assert CHILD not in rig.freezer.thawed_pids
    assert ("clear", [CHILD]) in rig.ledger.calls


def test_standing_down_after_the_freeze_does_not_continue_the_users_task(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD], user_stopped=[CHILD]))
    outcome = run(rig, chain("freeze", "checkpoint"), make_tree(ROOT, CHILD),
                  pressing=Pressure((False,)))
    assert outcome.result == "stood-down"
    assert rig.freezer.thawed == [[ROOT]]


def test_freeze_step_then_kill_kills_the_users_stopped_task_too(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD], user_stopped=[CHILD]),
                   free=SHORT)
    killed: list[list[int]] = []
    rig.runner.end_tree = lambda pids, *rest: killed.append(pids)  # type: ignore[method-assign]
    outcome = run(rig, chain("freeze", "checkpoint", "kill"), make_tree(ROOT, CHILD))
    assert outcome.result == "killed"
    assert killed == [[ROOT, CHILD]]


def test_freeze_records_the_tree_then_what_was_stopped(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD]), free=SHORT)
    run(rig, chain("freeze", "checkpoint"), make_tree(ROOT, CHILD))
    assert rig.ledger.calls == [("record", [ROOT, CHILD]), ("record", [ROOT, CHILD]),
                                ("clear", [ROOT, CHILD, ROOT, CHILD])]
    assert rig.freezer.thawed == [[ROOT, CHILD]]


def test_children_caught_while_the_freeze_settles_are_recorded_and_thawed(
        tmp_path: Path) -> None:
    """Forked as the tree stopped (seen on the connector): into the ledger at once, in the
    frozen tree given to on_frozen, and continued with the rest when the chain gives up."""
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD], caught=[EXTRA]), free=SHORT)
    seen: list[list[int]] = []

    def on_frozen(frozen: Frozen, at: float) -> None:
        seen.append(frozen.pids)

    run(rig, chain("freeze", "checkpoint"), make_tree(ROOT, CHILD), on_frozen=on_frozen)
    assert rig.ledger.calls == [("record", [ROOT, CHILD]), ("record", [ROOT, CHILD]),
                                ("record", [EXTRA]), ("clear", [ROOT, CHILD, ROOT, CHILD, EXTRA])]
    assert seen == [[ROOT, CHILD, EXTRA]]
    assert rig.freezer.thawed == [[ROOT, CHILD, EXTRA]]
    assert left_frozen(rig) == set()


def test_store_refusal_is_logged_and_checkpointer_never_called(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, free=5 * MiB)
    tree = make_tree(ROOT, rss_mib=300)
    outcome = run(rig, chain("checkpoint"), tree)
    assert outcome.result == "thawed"
    assert rig.checkpointer.calls == []
    level, fields = rig.log.find("checkpoint.refused")
    assert level == "error"
    assert fields["reason"] == (f"store {tmp_path / 'store'} has 5 MiB free, a checkpoint "
                                f"needs ~{(300 * MiB + SETTINGS.store_margin) >> 20} MiB")
    assert "MiB free" in fields["reason"]
    assert fields["cgroup"] == "/jobs/a" and fields["pid"] == ROOT
    assert fields["then"] == "nothing more: the tree runs on"  # the event says what runs next


def test_store_refusal_names_the_next_step(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, free=5 * MiB)
    run(rig, chain("checkpoint", "kill"), make_tree(ROOT, rss_mib=300))
    assert rig.checkpointer.calls == []
    _, fields = rig.log.find("checkpoint.refused")
    assert fields["then"] == "kill"


def test_store_margin_comes_from_settings(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, free=150 * MiB)
    settings = ChainSettings(store_margin=0)
    outcome = rig.runner.run(chain("checkpoint"), make_tree(rss_mib=100), None, REASON, settings,
                             Pressure(), dict(FIELDS))
    assert outcome.result == "checkpointed"
    rig2 = make_rig(tmp_path, free=150 * MiB)
    outcome = rig2.runner.run(chain("checkpoint"), make_tree(rss_mib=100), None, REASON,
                              ChainSettings(store_margin=64 * MiB), Pressure(), dict(FIELDS))
    assert outcome.result == "thawed"
    assert rig2.checkpointer.calls == []


def test_checkpoint_failure_logs_outcome_and_error(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, error=CheckpointFailed("checkpoint of 7 failed: boom", "thawed"))
    run(rig, chain("checkpoint"), make_tree())
    level, fields = rig.log.find("checkpoint.failed")
    assert level == "error"
    assert fields == {"outcome": "thawed", "error": "checkpoint of 7 failed: boom", **FIELDS}


def test_stand_down_thaws_the_frozen_pids(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD, EXTRA]))
    outcome = run(rig, chain("freeze", "checkpoint", "kill"), make_tree(ROOT, CHILD),
                  pressing=Pressure((False,)))
    assert (outcome.result, outcome.step) == ("stood-down", "checkpoint")
    assert outcome.settled
    assert rig.freezer.thawed == [[ROOT, CHILD, EXTRA]]
    assert rig.checkpointer.calls == []
    assert rig.ledger.balanced()
    assert rig.ledger.cleared >= {ROOT, CHILD, EXTRA}


def test_freeze_deadline_thaws_and_says_so(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD]))
    outcome = run(rig, chain("freeze", "checkpoint"), make_tree(ROOT, CHILD),
                  pressing=Pressure(hook=lambda: rig.clock.advance(90.0)))
    assert outcome.result == "thawed"
    assert "deadline" in outcome.detail and "60s" in outcome.detail
    assert not outcome.settled
    assert rig.freezer.thawed == [[ROOT, CHILD]]
    assert rig.checkpointer.calls == []


def test_freeze_gone_is_gone_and_nothing_thawed(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, freezer=FakeFreezer(gone=True))
    outcome = run(rig, chain("freeze", "checkpoint", "kill"), make_tree(ROOT, CHILD))
    assert outcome == ChainOutcome("gone", "", "the victim exited")
    assert not outcome.settled
    assert rig.freezer.thawed == []
    assert rig.ledger.calls == [("record", [ROOT, CHILD]), ("clear", [ROOT, CHILD])]


def test_ledger_clear_error_does_not_mask_the_outcome(tmp_path: Path) -> None:
    ledger = FakeLedger(clear_error=OSError(28, "No space left on device"))
    rig = make_rig(tmp_path, ledger=ledger, freezer=FakeFreezer([ROOT]), free=SHORT)
    outcome = run(rig, chain("freeze", "checkpoint"), make_tree(ROOT))
    assert outcome.result == "thawed"
    assert rig.freezer.thawed == [[ROOT]]  # thawed before the ledger is touched


def test_signal_to_a_vanished_victim_is_gone(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    outcome = run(rig, chain("signal:SIGTERM:5s", "checkpoint"), make_tree(ROOT))
    assert outcome == ChainOutcome("gone", "signal:SIGTERM:5s", "the victim exited")
    assert rig.checkpointer.calls == []
    assert "victim.signalled" not in rig.log.events


@pytest.mark.parametrize(
    ("result", "settled"),
    [
        ("checkpointed", True),
        ("signalled", True),
        ("killed", True),
        ("stood-down", True),
        ("thawed", False),
        ("gone", False),
        ("refused", False),
    ],
)
def test_settled(result: str, settled: bool) -> None:
    assert ChainOutcome(result, CHECKPOINT, "x").settled is settled


def test_settings_defaults() -> None:
    assert ChainSettings() == ChainSettings(freeze_deadline=60.0, kill_grace=5.0,
                                            store_margin=256 * MiB, headroom=64 * MiB)


# -- steps that signal a real child --------------------------------------------------------------

Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start real children (`sleep 60`, or a shell that ignores some signals then becomes
    sleep); every one is killed and reaped at the end, whatever happened."""
    children: list[subprocess.Popen[str]] = []

    def start(ignore: str = "") -> subprocess.Popen[str]:
        if ignore:
            script = f'trap "" {ignore}; echo ready; exec sleep 60'
            child = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
            children.append(child)
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
        else:
            child = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
            children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=10)
            if child.stdout is not None:
                child.stdout.close()


def state_of(pid: int) -> str:
    try:
        return ProcReader().state(pid)
    except ProcessGone:
        return "gone"


def real_rig(tmp_path: Path, **kwargs: Any) -> Rig:
    kwargs.setdefault("proc", ProcReader())
    return make_rig(tmp_path, real_nap=0.01, **kwargs)


def test_kill_after_failed_checkpoint(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, error=CheckpointFailed("criu said no", "thawed"))
    outcome = run(rig, chain("checkpoint", "kill"), make_tree(child.pid))
    assert outcome == ChainOutcome("killed", KILL, REASON)
    assert outcome.settled
    assert child.wait(timeout=5) == -signal.SIGTERM
    level, fields = rig.log.find("victim.killed")
    assert level == "error"
    assert fields["reason"] == REASON
    assert fields["sigkill"] == 0
    assert "no checkpoint was possible" in fields["explanation"]
    assert rig.log.events == ["checkpoint.failed", "victim.killed"]
    assert rig.ledger.balanced()


def test_kill_after_store_refusal(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, free=MiB)
    outcome = run(rig, chain("checkpoint", "kill"), make_tree(child.pid))
    assert outcome.result == "killed"
    assert rig.checkpointer.calls == []
    assert rig.log.events == ["checkpoint.refused", "victim.killed"]
    assert "MiB free" in rig.log.find("checkpoint.refused")[1]["reason"]
    assert child.wait(timeout=5) == -signal.SIGTERM


def test_kill_is_not_reached_when_the_checkpoint_succeeds(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path)
    outcome = run(rig, chain("checkpoint", "kill"), make_tree(child.pid))
    assert outcome.result == "checkpointed"
    assert child.poll() is None
    # Continued: running or asleep again (a moment in D, as the full suite's load once showed
    # right after the SIGCONT, is not a stop).
    deadline = time.monotonic() + 5
    while state_of(child.pid) not in ("R", "S") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state_of(child.pid) in ("R", "S"), state_of(child.pid)


def test_kill_a_frozen_victim(tmp_path: Path, spawn: Spawn) -> None:
    """The kill step continues a stopped task so it can act on SIGTERM."""
    child = spawn()
    freezer = StoppingFreezer()
    rig = real_rig(tmp_path, freezer=freezer)
    outcome = run(rig, chain("freeze", "kill"), make_tree(child.pid))
    assert outcome.result == "killed"
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert rig.log.find("victim.killed")[1]["sigkill"] == 0
    assert rig.ledger.balanced()


def test_kill_sigkills_what_ignores_sigterm(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn(ignore="TERM")
    rig = real_rig(tmp_path)
    settings = ChainSettings(kill_grace=0.5)
    outcome = run(rig, chain("kill"), make_tree(child.pid), settings=settings)
    assert outcome.result == "killed"
    assert child.wait(timeout=5) == -signal.SIGKILL
    assert rig.log.find("victim.killed")[1]["sigkill"] == 1
    # the grace was waited out on the injected clock
    assert sum(rig.clock.sleeps) == pytest.approx(0.5, abs=0.051)


def test_kill_step_not_reached_when_pressure_passes(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, free=MiB)
    outcome = run(rig, chain("checkpoint", "kill"), make_tree(child.pid),
                  pressing=Pressure((False,)))
    assert (outcome.result, outcome.step) == ("stood-down", "kill")
    assert child.poll() is None and state_of(child.pid) in ("R", "S")


def test_signal_term_victim_exits(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path)
    outcome = run(rig, chain("signal:SIGTERM:30s", "checkpoint"), make_tree(child.pid))
    assert outcome == ChainOutcome("signalled", "signal:SIGTERM:30s", "the victim exited")
    assert outcome.settled
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert rig.checkpointer.calls == []
    level, fields = rig.log.find("victim.signalled")
    assert (level, fields["signal"], fields["grace_s"]) == ("warning", "SIGTERM", 30.0)
    assert sum(rig.clock.sleeps) < 30.0


def test_signal_thaws_a_frozen_victim_first(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    freezer = StoppingFreezer()
    rig = real_rig(tmp_path, freezer=freezer)
    outcome = run(rig, chain("freeze", "signal:SIGTERM:30s", "checkpoint"), make_tree(child.pid))
    assert outcome.result == "signalled"
    assert freezer.thawed == [[child.pid]]
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert rig.ledger.balanced()


def test_ignored_signal_falls_through_to_the_checkpoint(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn(ignore="USR1")
    rig = real_rig(tmp_path)
    outcome = run(rig, chain("signal:SIGUSR1:1s", "checkpoint"), make_tree(child.pid))
    assert outcome.result == "checkpointed"
    assert len(rig.checkpointer.calls) == 1
    assert child.poll() is None  # still there: the (fake) checkpoint did not touch it
    assert sum(rig.clock.sleeps) == pytest.approx(1.0, abs=0.11)


def test_signal_then_pressure_passes_is_signalled(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn(ignore="USR1")
    rig = real_rig(tmp_path)
    outcome = run(rig, chain("signal:SIGUSR1:30s", "checkpoint"), make_tree(child.pid),
                  pressing=Pressure((True, False)))
    assert outcome == ChainOutcome("signalled", "signal:SIGUSR1:30s", "the victim shrank")
    assert rig.checkpointer.calls == []
    assert child.poll() is None


# -- known bugs ----------------------------------------------------------------------------------

def test_signal_victim_exiting_between_reads_is_signalled(tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, proc=RacingProc())
    outcome = run(rig, chain("signal:SIGTERM:30s", "checkpoint"), make_tree(child.pid))
    assert outcome.result == "signalled"


def test_freeze_then_kill_leaves_no_task_stopped(tmp_path: Path, spawn: Spawn) -> None:
    root, late = spawn(), spawn()
    freezer = StoppingFreezer([root.pid, late.pid])
    rig = real_rig(tmp_path, freezer=freezer)
    outcome = run(rig, chain("freeze", "kill"), make_tree(root.pid))
    assert outcome.result == "killed"
    assert root.wait(timeout=5) == -signal.SIGTERM
    assert state_of(late.pid) != "T"


@pytest.mark.parametrize("last", ["kill", "signal:SIGTERM:30s"])
def test_ledger_cleared_of_every_frozen_pid(tmp_path: Path, spawn: Spawn, last: str) -> None:
    root, late = spawn(), spawn()
    freezer = StoppingFreezer([root.pid, late.pid])
    rig = real_rig(tmp_path, freezer=freezer)
    run(rig, chain("freeze", last), make_tree(root.pid))
    assert rig.ledger.recorded == {root.pid, late.pid}
    assert rig.ledger.balanced(), rig.ledger.calls



# -- Kubernetes containers: the kubelet checkpoints them, never CRIU behind the runtime ------------

KUBE_CGROUP = ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6b1a4c2e_9f3d_4e8a_"
               "b7c6_0d1e2f3a4b5c.slice/cri-containerd-" + "ab" * 32 + ".scope")


class FakeContainers:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.error = error

    def checkpoint(self, pod_uid: str, container_id: str | None) -> tuple[Any, list[str]]:
        from oomguard.act.kubelet import ContainerRef
        self.calls.append((pod_uid, container_id))
        if self.error is not None:
            raise self.error
        return ContainerRef("ml", "trainer-0", "trainer"), ["/var/lib/kubelet/checkpoints/c.tar"]


def kube_rig(tmp_path: Path, containers: FakeContainers | None) -> Rig:
    rig = make_rig(tmp_path, proc=FakeProc({ROOT: "S"}, cgroup=KUBE_CGROUP))
    rig.runner.containers = containers  # type: ignore[assignment]
    return rig


def test_container_is_checkpointed_by_the_kubelet_then_killed(tmp_path: Path) -> None:
    containers = FakeContainers()
    rig = kube_rig(tmp_path, containers)
    outcome = run(rig, (Step(CHECKPOINT),), make_tree())
    assert outcome.result == "killed" and "/var/lib/kubelet/checkpoints/c.tar" in outcome.detail
    assert containers.calls == [("6b1a4c2e-9f3d-4e8a-b7c6-0d1e2f3a4b5c", "ab" * 32)]
    assert rig.checkpointer.calls == []  # CRIU never ran
    events = [e for _, e, _ in rig.log.records]
    assert events[:2] == ["kubelet.checkpointed", "victim.killed"]


def test_container_without_kubelet_access_is_refused_untouched(tmp_path: Path) -> None:
    rig = kube_rig(tmp_path, None)
    outcome = run(rig, (Step(CHECKPOINT),), make_tree())
    assert outcome.result == "thawed" and outcome.detail == "no action settled it"
    refused = [f for _, e, f in rig.log.records if e == "checkpoint.refused"]
    assert "not dumped behind its runtime's back" in refused[0]["reason"]
    assert refused[0]["then"] == "nothing more: the tree runs on"
    assert rig.checkpointer.calls == [] and not rig.freezer.frozen


def test_kubelet_refusal_falls_through_to_the_next_action(tmp_path: Path) -> None:
    from oomguard.act.kubelet import KubeletError
    rig = kube_rig(tmp_path, FakeContainers(KubeletError("kubelet POST /checkpoint: HTTP 403")))
    outcome = run(rig, (Step(CHECKPOINT), Step(KILL)), make_tree())
    assert outcome.result == "killed" and outcome.step == "kill"
    assert ("error", "checkpoint.failed") in [(lvl, e) for lvl, e, _ in rig.log.records]


# -- the steps as objects (oomguard.respond.chainsteps) ----------------------------------------------

def test_every_kind_of_step_has_its_object(tmp_path: Path) -> None:
    from oomguard.config import actions as steps

    kinds = {steps.FREEZE, steps.CHECKPOINT, steps.SIGNAL, steps.KILL, steps.VRAM,
             steps.PAGEOUT}
    assert set(make_rig(tmp_path).runner.actions) == kinds


def test_a_freeze_continues_holding_the_tree_and_a_refused_checkpoint_continues(
        tmp_path: Path) -> None:
    from oomguard.respond.chainstate import CONTINUE, ChainRun, Settled

    rig = make_rig(tmp_path, free=SHORT, freezer=FakeFreezer([ROOT, CHILD]))
    state = ChainRun(make_tree(ROOT, CHILD), None, REASON, SETTINGS, Pressure(), dict(FIELDS))
    assert rig.runner.actions["freeze"].run(parse_step("freeze"), state) is CONTINUE
    assert state.frozen == [ROOT, CHILD] and state.frozen_at == T0
    # No room in the store: refused, the tree still held for the next step.
    assert rig.runner.actions["checkpoint"].run(parse_step("checkpoint"), state) is CONTINUE
    assert state.frozen == [ROOT, CHILD]
    assert [e for _l, e, _f in rig.log.records] == ["checkpoint.refused"]
    killed: list[list[int]] = []
    rig.runner.end_tree = lambda pids, *rest: killed.append(pids)  # type: ignore[method-assign]
    ended = rig.runner.actions["kill"].run(parse_step("kill"), state)
    assert isinstance(ended, Settled) and ended.outcome.result == "killed"
    assert killed == [[ROOT, CHILD]] and state.frozen == []


@pytest.mark.parametrize(("error", "called_by"), [
    (CheckpointFailed("pid 1 is traced by pid 2 (strace): CRIU cannot dump a traced task",
                      FailedCheckpoint.UNTOUCHED, lasting="traced"), "freeze"),
    (CheckpointFailed("criu dump failed", FailedCheckpoint.THAWED), "checkpoint")])
def test_a_checkpoint_refused_before_the_stop_leaves_after_signal_to_the_next_freeze(
        tmp_path: Path, error: CheckpointFailed, called_by: str) -> None:
    """after_signal (the daemon's thaw of a v2-frozen cgroup) runs once the tree's SIGSTOPs
    are sent. A checkpoint refused before the stop never sent them: the freeze of the next
    step (a page-out's) must thaw the cgroup, else the tree waits in the cgroup's freezer and
    never stops (issue 29, the v2 lane's traced job). A checkpoint that stopped the tree
    called it: no second call."""
    from oomguard.respond.chainstate import CONTINUE, ChainRun

    rig = make_rig(tmp_path, freezer=FakeFreezer([ROOT, CHILD]), error=error)
    calls: list[str] = []
    state = ChainRun(make_tree(ROOT, CHILD), None, REASON, SETTINGS, Pressure(), dict(FIELDS),
                     after_signal=lambda: calls.append("after_signal"))
    if called_by == "checkpoint":  # the checkpointer stops the tree and calls it
        rig.checkpointer.on_call = lambda call: call["after_signal"]()
        rig.freezer.pids = [ROOT, CHILD]
    assert rig.runner.actions["checkpoint"].run(parse_step("checkpoint"), state) is CONTINUE
    assert calls == ([] if called_by == "freeze" else ["after_signal"])
    assert rig.runner.actions["freeze"].run(parse_step("freeze"), state) is CONTINUE
    assert calls == ["after_signal"] and state.after_signal is None
    assert state.frozen == [ROOT, CHILD]


# -- a limit lifted for a dump that could not be put back ----------------------------------------

BUSY = "usage 304619520 is above the limit 268435456 to put back"


def test_a_failed_dump_whose_limit_stays_lifted_is_killed_once_without_a_kill_step(
        tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, error=CheckpointFailed("criu said no", "thawed", limit_busy=BUSY))
    outcome = run(rig, chain("checkpoint"), make_tree(child.pid))
    assert outcome.result == "killed" and outcome.settled
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert rig.log.events == ["checkpoint.failed", "victim.killed"]
    failed = rig.log.find("checkpoint.failed")[1]
    assert failed["limit_busy"] == BUSY and failed["then"].startswith("kill")
    killed = rig.log.find("victim.killed")[1]
    assert killed["limit_busy"] == BUSY and "room lifted for its dump" in killed["explanation"]
    assert len(rig.checkpointer.calls) == 1 and rig.ledger.balanced()


def test_a_failed_dump_whose_limit_stays_lifted_goes_on_to_the_kill_step_pressure_or_not(
        tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, error=CheckpointFailed("criu said no", "thawed", limit_busy=BUSY))
    outcome = run(rig, chain("checkpoint", "kill"), make_tree(child.pid),
                  pressing=Pressure((False,)))  # the limit is pressure whatever usage says
    assert (outcome.result, outcome.step) == ("killed", KILL)
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert rig.log.events == ["checkpoint.failed", "victim.killed"]


def test_a_lift_left_busy_has_a_refused_tree_killed_down_the_chain(
        tmp_path: Path, spawn: Spawn) -> None:
    """The settling's look (limit_busy given): a tree no checkpoint can take is refused, then
    killed, where before it was left running with the limit lifted."""
    child = spawn()
    rig = real_rig(tmp_path, error=CheckpointFailed(
        "refused before stopping it: traced", "untouched", lasting="traced by pid 7"))
    outcome = rig.runner.run(chain("checkpoint"), make_tree(child.pid), None, REASON, SETTINGS,
                             Pressure(), dict(FIELDS), limit_busy=BUSY)
    assert outcome.result == "killed"
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert rig.log.events == ["checkpoint.refused", "victim.killed"]
    assert rig.log.find("checkpoint.refused")[1]["then"].startswith("kill")


def test_without_a_busy_limit_a_failed_dump_is_thawed_not_killed(
        tmp_path: Path, spawn: Spawn) -> None:
    child = spawn()
    rig = real_rig(tmp_path, error=CheckpointFailed("criu said no", "thawed"))
    outcome = run(rig, chain("checkpoint"), make_tree(child.pid))
    assert outcome.result == "thawed"
    assert child.poll() is None and rig.log.events == ["checkpoint.failed"]
