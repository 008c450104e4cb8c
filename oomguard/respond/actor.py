"""Acting on a rule's verdict: choose the victim (in order of preference), run the rule's action
chain on it, report. Runs in worker threads (kept between actions), so a signal's grace period
or a long dump never holds up the guard loop; one action per guard at a time."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.act.frozen import Frozen
from oomguard.act.priority import ThreadPriority
from oomguard.cgroup.base import FreezableCgroup, MemoryCgroup, subtree_procs
from oomguard.config.actions import DEFAULT_CHAIN, KILL, PAGEOUT, Step
from oomguard.config.loading import GuardConfig
from oomguard.config.schema import ON_FAILURE_KILL
from oomguard.model.errors import CgroupGone
from oomguard.model.patterns import compile_patterns
from oomguard.observe.decisionlog import DecisionLog
from oomguard.observe.events import CheckpointDone, EventSink, VictimFrozen, sink_for
from oomguard.policy.preferences import Preferences, apply_preferences
from oomguard.policy.retry import retry_delay
from oomguard.policy.unfit import UnfitMarks
from oomguard.policy.victims import ProcessTree
from oomguard.respond.chain import ChainOutcome, ChainResult, ChainRunner, ChainSettings
from oomguard.sense.procfs import ProcReader, threads_told

MiB = 1 << 20
MAX_VICTIM_ATTEMPTS = 3
NEXT_VICTIM_SHARE = 4  # a fallback victim must hold at least a quarter of the top one's RSS
# A task throttled at memory.high sleeps out its penalty (up to 2 s, killable only) before the
# freezer can park it; it allocates nothing meanwhile, so waiting longer buys nothing.
CGROUP_FREEZE_TIMEOUT = 0.25
# Where a task waits once the v2 freezer has it (its wchan): do_freezer_trap, or get_signal
# where the kernel inlined it (6.1); a stopped task counts as frozen too (do_signal_stop).
PARKED_WAITS = frozenset({"do_freezer_trap", "get_signal", "do_signal_stop"})


KEEP_WORKERS = 4  # idle action threads kept for the next crossing


def unparked(path: Path, proc: ProcReader) -> list[dict[str, object]]:
    """The threads of a cgroup's subtree that its freezer has not parked yet, with their state
    and where they sleep (a task throttled at memory.high sleeps out its penalty in
    mem_cgroup_handle_over_high first): what a freeze that did not end in time waits for."""
    try:
        pids = subtree_procs(path)
    except (OSError, CgroupGone):
        return []
    return threads_told(proc, pids, lambda wait: wait.wchan not in PARKED_WAITS)


class Workers:
    """Daemon threads that outlive one action: starting a thread costs about half a
    millisecond, on the path from a crossing to SIGSTOP. A thread is started only when none is
    idle; up to KEEP_WORKERS idle ones are kept. An idle one waits at the guard's niceness
    (`priority`), so it wakes as promptly as the loop that hands it the crossing; the work
    lowers it once its victim is stopped."""

    def __init__(self, keep: int = KEEP_WORKERS, priority: ThreadPriority | None = None) -> None:
        self.keep = keep
        self.priority = priority
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, work: Callable[[], None]) -> threading.Event:
        """Run `work` in a worker thread; the event is set when it has ended."""
        done = threading.Event()
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1  # that idle thread takes an item off the queue
        self._queue.put((work, done))
        if spawn:
            threading.Thread(target=self._serve, name="oomguard-act", daemon=True).start()
        return done

    def _serve(self) -> None:
        while True:
            if self.priority is not None:
                self.priority.raise_()
            work, done = self._queue.get()
            try:
                work()
            finally:
                done.set()
            with self._lock:
                if self._idle >= self.keep:
                    return
                self._idle += 1


@dataclass(frozen=True)
class RuleParts:
    chain: tuple[Step, ...]
    prefs: Preferences
    settings: ChainSettings


def rule_parts(spec: GuardConfig) -> RuleParts:
    """A rule's compiled pieces. Without `actions`: checkpoint, then page-out (what CRIU
    cannot dump), then, with `on_failure = "kill"`, kill."""
    chain = spec.actions or tuple(Step(kind) for kind in DEFAULT_CHAIN) + (
        (Step(KILL),) if spec.on_failure == ON_FAILURE_KILL else ())
    prefs = Preferences(prefer=compile_patterns(spec.prefer), avoid=compile_patterns(spec.avoid),
                        protect=compile_patterns(spec.protect),
                        protect_session_leaders=spec.protect_session_leaders,
                        take_sessions=spec.take_sessions, gpu=spec.gpu)
    settings = ChainSettings(freeze_deadline=spec.freeze_deadline, kill_grace=spec.kill_grace,
                             store_margin=spec.store_margin, headroom=spec.headroom)
    return RuleParts(chain, prefs, settings)


@dataclass
class Request:
    """One action to take: who, where, why; `candidates` is called once the cgroup is frozen."""

    name: str
    parts: RuleParts
    woke: float
    reason: str
    candidates: Callable[[], list[ProcessTree]]
    cgroup_for: Callable[[ProcessTree], MemoryCgroup | None]
    still_pressing: Callable[[], bool]
    freeze_first: FreezableCgroup | None = None  # frozen whole first (cgroup.freeze_cgroup)
    # A tree ranked from cached readings is read afresh before anything is done to it (None:
    # the candidates are fresh already); returns None if its root is gone.
    refresh: Callable[[ProcessTree], ProcessTree | None] | None = None
    # Why a limit lifted for a dump could not be put back: trees refused for good are not
    # left out, and the chain goes down to a kill if it must (chainsteps.CheckpointAction).
    limit_busy: str = ""


class Actor:
    def __init__(self, runner: ChainRunner, log: Any, *, dry_run: bool,
                 on_checkpoint: Callable[[int, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 decisions: DecisionLog | None = None,
                 on_done: Callable[[str], None] | None = None,
                 priority: ThreadPriority | None = None,
                 events: EventSink | None = None, proc: ProcReader | None = None) -> None:
        self.runner = runner
        self.proc = proc or ProcReader()
        self.priority = priority
        self.on_done = on_done  # called (from the action's thread) when an action has ended
        self.log = log
        self.events = sink_for(log, events)  # frozen, checkpointed
        self.dry_run = dry_run
        self.decisions = decisions or DecisionLog(clock)  # a dry run's repeated decisions
        self.on_checkpoint = on_checkpoint
        self.clock = clock
        self._workers = Workers(priority=priority)
        self._running: dict[str, threading.Event] = {}  # guard name -> set once its action ended
        self.last_done: dict[str, float] = {}
        self._unfit_said: dict[str, tuple[str, ...]] = {}  # per rule: the marked trees last told
        # Per rule: actions in a row that settled nothing, and when it may act again.
        self._unsettled: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}

    def busy(self, name: str) -> bool:
        done = self._running.get(name)
        return done is not None and not done.is_set()

    def may_act(self, name: str, post_action_delay: float, now: float,
                urgent: bool = False) -> bool:
        """The one gate of every trigger (cgroup, system, GPU): nothing of `name`'s running,
        its last action ended at least `post_action_delay` ago, and, after actions that
        settled nothing, its retry is due (policy/retry.py). `urgent` (a lifted limit that
        could not be put back) waits for no retry."""
        if self.busy(name):
            return False
        if not urgent and now < self._retry_at.get(name, -1e9):
            return False
        return now - self.last_done.get(name, -1e9) >= post_action_delay

    def retry_at(self, name: str) -> float | None:
        """When `name` may act again after actions that settled nothing (None: no wait)."""
        return self._retry_at.get(name)

    def left_alone(self, name: str) -> bool:
        """The rule's last action found only trees refused for good (it left them running)."""
        return name in self._unfit_said

    def start(self, request: Request) -> None:
        self._running[request.name] = self._workers.run(lambda: self._act(request))

    def join(self, timeout: float | None = None) -> None:
        """Let actions in flight finish (a dump is not abandoned half way)."""
        for done in list(self._running.values()):
            done.wait(timeout)

    def _act(self, request: Request) -> None:
        ledger = self.runner.checkpointer.ledger
        cgroup = request.freeze_first
        thawed = cgroup is None

        def thaw() -> None:
            nonlocal thawed
            if not thawed:
                with contextlib.suppress(OSError, CgroupGone):
                    cgroup.thaw()  # type: ignore[union-attr]
                thawed = True

        try:
            if cgroup is not None and not self.dry_run:
                ledger.record_cgroup(cgroup.path)
                cgroup.freeze()
                frozen = cgroup.wait_frozen(CGROUP_FREEZE_TIMEOUT)
                waited_ms = round((self.clock() - request.woke) * 1000, 2)
                more = {} if frozen else {"unparked": unparked(cgroup.path, self.proc)}
                self.log.info("cgroup.frozen", cgroup=request.name, frozen=frozen,
                              detect_to_frozen_ms=waited_ms, **more)
            self._run(request, thaw)
        except (OSError, CgroupGone) as exc:
            self.log.error("action.failed", cgroup=request.name, error=str(exc))
        finally:
            thaw()
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    ledger.clear_cgroup(cgroup.path)
            self.last_done[request.name] = self.clock()
            if self.on_done is not None:
                self.on_done(request.name)

    def _run(self, request: Request, thaw: Callable[[], None]) -> None:
        began = self.clock()
        marks = None if self.dry_run else self.runner.marks  # a dry run refuses nothing
        pages_out = any(step.kind == PAGEOUT for step in request.parts.chain)
        ranked, unfit = self._ranked(request, marks, pages_out)
        choose_ms = round((self.clock() - began) * 1000, 2)  # reading and ranking the trees
        if not ranked:
            if unfit:
                self._say_unfit_only(request.name, unfit)
            elif not self.dry_run or self.decisions.due(request.name, "victim", None) is not None:
                self.log.warning("victim.none", cgroup=request.name,
                                 explanation="no process here may be checkpointed")
            return
        self._unfit_said.pop(request.name, None)
        # After a failure only trees that would free real memory are worth a try.
        worth = [t for t in ranked[1:] if t.rss_bytes * NEXT_VICTIM_SHARE >= ranked[0].rss_bytes]
        after_signal: Callable[[], None] | None = thaw
        last: ChainOutcome | None = None  # the last chain that ended unsettled
        for candidate in [ranked[0], *worth][:MAX_VICTIM_ATTEMPTS]:
            read_at = self.clock()
            tree = request.refresh(candidate) if request.refresh is not None else candidate
            if tree is None:
                continue  # gone since it was ranked
            if request.refresh is not None and marks is not None and marks.reason(tree) \
                    and not request.limit_busy and not pages_out:
                continue  # refused for good before (it was a ranking's stand-ins until now)
            fields = self._victim_fields(request, tree, read_at)
            if self.dry_run:
                self._say_chosen(request, tree, {**fields, "choose_ms": choose_ms})
                return
            cgroup = request.cgroup_for(tree)
            outcome = self.runner.run(request.parts.chain, tree, cgroup, request.reason,
                                      request.parts.settings, request.still_pressing, fields,
                                      on_frozen=self._on_frozen(request, choose_ms, fields),
                                      after_signal=after_signal,
                                      limit_busy=request.limit_busy)
            after_signal = None
            thaw()
            self._tell_outcome(outcome, fields, cgroup)
            if outcome.checkpoint is None and outcome.result is ChainResult.GONE:
                continue
            if outcome.settled:
                self._unsettled.pop(request.name, None)
                self._retry_at.pop(request.name, None)
                return
            last = outcome  # (a victim that exited went on to the next above)
        if last is not None:
            self._back_off(request.name, last.step, last.detail)

    def _ranked(self, request: Request, marks: UnfitMarks | None,
                pages_out: bool) -> tuple[list[ProcessTree], list[str]]:
        """The candidates in the order they are tried, and what was refused for good (as
        the marks word it). Trees no checkpoint can take while they live were refused once:
        never again. A chain that pages out takes them last instead (its checkpoint step
        refuses them at once): paged out and resumed, such a tree that grows again is paged
        out again, not left to the kernel's OOM killer."""
        ranked = apply_preferences(request.candidates(), request.parts.prefs)
        unfit: list[str] = []
        if marks is not None and not request.limit_busy:
            marks.forget_gone()
            everyone = ranked
            ranked, unfit = marks.split(everyone, fresh=request.refresh is None)
            if pages_out:
                kept = {id(tree) for tree in ranked}
                ranked, unfit = ranked + [t for t in everyone if id(t) not in kept], []
        return ranked, unfit

    def _victim_fields(self, request: Request, tree: ProcessTree,
                       read_at: float) -> dict[str, Any]:
        """The chosen victim, as every event of its chain names it."""
        fields: dict[str, Any] = {"cgroup": request.name, "pid": tree.root.pid,
                                  "comm": tree.root.comm, "rss": tree.rss_bytes,
                                  "tasks": len(tree.members)}
        if request.refresh is not None:  # the chosen tree read afresh, after the choice
            fields["reread_ms"] = round((self.clock() - read_at) * 1000, 2)
        if tree.unfit:
            fields["unfit"] = tree.unfit
        if request.limit_busy:
            fields["limit_busy"] = request.limit_busy
        return fields

    def _on_frozen(self, request: Request, choose_ms: float,
                   fields: dict[str, Any]) -> Callable[[Frozen, float], None]:
        def frozen(stopped: Frozen, at: float) -> None:
            if self.priority is not None:
                self.priority.lower()  # the dump competes with the user's work as an equal
            self.events.publish(VictimFrozen(round((at - request.woke) * 1000, 2),
                                             choose_ms, stopped.fields(), fields))
        return frozen

    def _tell_outcome(self, outcome: ChainOutcome, fields: dict[str, Any],
                      cgroup: MemoryCgroup | None) -> None:
        """One event for how a victim's chain ended."""
        if outcome.checkpoint is not None:
            result = outcome.checkpoint
            self.events.publish(CheckpointDone(result.meta, result.timings, fields,
                                               str(result.path), _usage(cgroup)))
            if self.on_checkpoint is not None:
                self.on_checkpoint(result.meta.image_bytes, result.timings.dump_s)
        elif outcome.result is ChainResult.GONE:
            self.log.info("victim.gone", **fields)
        elif outcome.result is ChainResult.STOOD_DOWN:
            self.log.info("action.stood_down", step=outcome.step, detail=outcome.detail,
                          **fields)
        elif outcome.result is ChainResult.SIGNALLED:
            self.log.warning("action.signalled", step=outcome.step, detail=outcome.detail,
                             **fields)
        elif not outcome.settled:
            self.log.warning("victim.thawed", step=outcome.step, detail=outcome.detail,
                             **fields)

    def _back_off(self, name: str, step: str, detail: str) -> None:
        """Every chain of this action ended unsettled: the rule waits before its next try,
        longer each time (said once per try, with when the next one comes)."""
        count = self._unsettled.get(name, 0) + 1
        self._unsettled[name] = count
        wait = retry_delay(count)
        self._retry_at[name] = self.clock() + wait
        self.log.warning("action.backoff", cgroup=name, unsettled=count, retry_in_s=wait,
                         step=step, detail=detail,
                         explanation="nothing settled the pressure; the next try waits "
                         "(longer after each try that settles nothing)")


    def _say_unfit_only(self, name: str, unfit: list[str]) -> None:
        """Only trees refused before for good are left: said once (again if they change)."""
        if self._unfit_said.get(name) != tuple(unfit):
            self._unfit_said[name] = tuple(unfit)
            self.log.warning("victim.none", cgroup=name, unfit=unfit,
                             explanation="the only trees here cannot be checkpointed while "
                             "they live and were refused already: left running, not retried")

    def _say_chosen(self, request: Request, tree: ProcessTree, fields: dict[str, Any]) -> None:
        """A dry run's decision: said once, then when it changes or once a minute."""
        actions = [str(s) for s in request.parts.chain]
        decision = (tree.root.pid, tree.root.starttime, tuple(actions))
        unsaid = self.decisions.due(request.name, "victim", decision)
        if unsaid is not None:
            self.log.warning("victim.chosen", dry_run=True, actions=actions,
                             command=tree.root.command, rss_mib=round(tree.rss_bytes / MiB),
                             reason=request.reason, unchanged_since=unsaid or None, **fields)


def _usage(cgroup: MemoryCgroup | None) -> int | None:
    if cgroup is None:
        return None
    try:
        return cgroup.snapshot().usage_bytes
    except CgroupGone:
        return None
