"""Where the daemon makes its typed events (observe/events.py): each site publishes the event
to the sink it was given, once, and writes no line of its own for it (the publisher writes the
line from the event). The sites: the actor (victim.frozen, checkpoint.done), the chain's steps
(checkpoint.refused, checkpoint.failed, victim.killed), the keeper's auto-restore and the
control service (restore.done, restore.failed, checkpoint.done on request)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.act.criu import Criu
from oomguard.act.freezer import SigstopFreezer
from oomguard.act.frozen import BY_EVENTS, Frozen
from oomguard.config.loading import GuardConfig, load_config_text
from oomguard.control.service import Service
from oomguard.daemon.autorestore import RESTORE_BACKOFF, AutoRestorer
from oomguard.daemon.loop import Daemon
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.lifecycle.checkpointrun import CheckpointResult, CheckpointTimings
from oomguard.lifecycle.restoreoutcome import RestoreResult
from oomguard.model.errors import CheckpointFailed as CheckpointError
from oomguard.model.errors import FailedCheckpoint, StoreOverBudget
from oomguard.model.errors import RestoreFailed as RestoreError
from oomguard.observe.events import (
    CheckpointDone,
    CheckpointFailed,
    CheckpointRefused,
    Event,
    LogSink,
    RestoreDone,
    RestoreFailed,
    VictimFrozen,
    VictimKilled,
)
from oomguard.policy.unfit import UnfitMarks
from oomguard.policy.victims import ProcessTree
from oomguard.respond.actor import Actor, Request, rule_parts
from oomguard.respond.chain import ChainOutcome, ChainResult
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from tests.helpers import KeptLog
from tests.unit._support import FakeProc, fake_proc_tree, proc_info
from tests.unit.test_chain import CHILD, FIELDS, REASON, ROOT, chain, make_rig, make_tree, run
from tests.unit.test_loop import Clock, FakeEpoll
from tests.unit.test_restore_failures import NO_CGROUPS, stored
from tests.unit.test_store import make_meta

TIMINGS = CheckpointTimings(freeze_s=0.01, dump_s=1.2, commit_s=0.05, total_s=1.3)


class Published:
    """A sink that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def publish(self, event: Event) -> None:
        self.events.append(event)


class Lines:
    """A logger: the lines a site wrote itself."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append(event)


# -- the actor ------------------------------------------------------------------------------------

def test_the_actor_publishes_the_freeze_and_the_checkpoint() -> None:
    tree = ProcessTree(root=proc_info(4242, rss_mib=100), members=(proc_info(4242, rss_mib=100),))
    result = CheckpointResult(make_meta("c-1", image_bytes=1 << 30), Path("/store/c-1"), TIMINGS)

    class Runner:
        checkpointer = SimpleNamespace(ledger=None)
        marks = UnfitMarks(lambda pid: 0)

        def run(self, steps: Any, tree: Any, cgroup: Any, reason: str, settings: Any,
                still: Any, fields: dict[str, Any], on_frozen: Any = None,
                after_signal: Any = None, limit_busy: str = "") -> ChainOutcome:
            on_frozen(Frozen([4242], [], method=BY_EVENTS, caught=2), 10.25)
            return ChainOutcome(ChainResult.CHECKPOINTED, "checkpoint", reason, result)

    sink, lines, dumps = Published(), Lines(), []
    actor = Actor(Runner(), lines, dry_run=False, clock=lambda: 10.0,  # type: ignore[arg-type]
                  on_checkpoint=lambda size, seconds: dumps.append((size, seconds)), events=sink)
    cgroup = SimpleNamespace(snapshot=lambda: SimpleNamespace(usage_bytes=123))
    request = Request(name="/jobs", parts=rule_parts(GuardConfig(cgroups=("/jobs",))), woke=10.0,
                      reason="full", candidates=lambda: [tree], cgroup_for=lambda t: cgroup,
                      still_pressing=lambda: True)
    actor._run(request, lambda: None)
    victim = {"cgroup": "/jobs", "pid": 4242, "comm": "p4242", "rss": 100 << 20, "tasks": 1}
    assert sink.events == [
        VictimFrozen(250.0, 0.0, {"freeze": BY_EVENTS, "forks_caught": 2}, victim),
        CheckpointDone(result.meta, TIMINGS, victim, "/store/c-1", 123)]
    assert dumps == [(1 << 30, 1.2)]
    assert lines.events == []


# -- the chain's steps ----------------------------------------------------------------------------

def test_the_chain_publishes_a_refusal_then_the_kill(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, free=0)
    sink = Published()
    rig.runner.events = sink
    run(rig, chain("checkpoint", "kill"), make_tree(ROOT, CHILD))
    detail = (f"store {tmp_path / 'store'} has 0 MiB free, a checkpoint needs ~456 MiB")
    assert sink.events == [CheckpointRefused(detail, {**FIELDS, "then": "kill"}),
                           VictimKilled(REASON, 0, FIELDS)]
    assert rig.log.events == []  # no line but what the publisher writes


def test_the_chain_names_the_store_budget_in_its_refusal_then_kills(tmp_path: Path) -> None:
    """A checkpoint the store's budget has no room for: checkpoint.refused with the budget's
    figures and what runs next, then that next step, once."""
    figures = {"used": 90, "cap": 100, "free": 500, "keep_free": 450, "need": 30, "pending": 0}
    refusal = StoreOverBudget("checkpoint of 4242 refused before stopping it: the store's "
                              "budget has no room", FailedCheckpoint.UNTOUCHED, figures)
    rig = make_rig(tmp_path, error=refusal)
    sink = Published()
    rig.runner.events = sink
    run(rig, chain("checkpoint", "kill"), make_tree(ROOT, CHILD))
    assert sink.events == [CheckpointRefused(str(refusal), {**FIELDS, **figures, "then": "kill"}),
                           VictimKilled(REASON, 0, FIELDS)]
    assert rig.log.events == []


def test_the_chain_publishes_a_failure_then_the_kill(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, error=CheckpointError("CRIU: no space", FailedCheckpoint.THAWED))
    sink = Published()
    rig.runner.events = sink
    run(rig, chain("checkpoint", "kill"), make_tree(ROOT, CHILD))
    assert sink.events == [CheckpointFailed(FailedCheckpoint.THAWED, "CRIU: no space", FIELDS),
                           VictimKilled(REASON, 0, FIELDS)]
    assert rig.log.events == []


# -- the daemon's auto-restore ------------------------------------------------------------------

def keeper(tmp_path: Path, restore: Any, sink: Published) -> tuple[AutoRestorer, Lines]:
    store, lines = stored(tmp_path / "store"), Lines()
    return AutoRestorer(store, SimpleNamespace(restore=restore),  # type: ignore[arg-type]
                        lines, clock=lambda: 100.0, events=sink), lines


def test_an_auto_restore_publishes_restore_done_as_auto(tmp_path: Path) -> None:
    result = RestoreResult(meta=make_meta("job-1"), pid=777, seconds=0.4)
    sink = Published()
    keeping, lines = keeper(tmp_path, lambda checkpoint_id, **_: result, sink)
    keeping.restore(SimpleNamespace(name="/sys/fs/cgroup/memory/jobs",  # type: ignore[arg-type]
                                          cgroup=None), "job-1")
    [done] = sink.events
    assert isinstance(done, RestoreDone) and done.auto and done.result is result
    assert done.log_fields()["cgroup"] == "/sys/fs/cgroup/memory/jobs"
    assert lines.events == []


def test_a_failed_auto_restore_publishes_restore_failed_with_its_retry(tmp_path: Path) -> None:
    def restore(checkpoint_id: str, **_: Any) -> Any:
        raise RestoreError("criu restore of job-1 failed\nits log says more")

    sink = Published()
    keeping, lines = keeper(tmp_path, restore, sink)
    keeping.restore(SimpleNamespace(name="/jobs", cgroup=None,  # type: ignore[arg-type]
                                    spec=GuardConfig(cgroups=())), "job-1")
    assert sink.events == [RestoreFailed("job-1", {"error": "criu restore of job-1 failed"},
                                         "/jobs", retry_in_s=RESTORE_BACKOFF)]
    assert lines.events == []


def test_the_last_failed_auto_restore_marks_the_checkpoint_stuck(tmp_path: Path) -> None:
    """After restore_attempts failures: restore.failed without a retry, restore.stuck with the
    reason, and the reason and the count in its meta.json; never tried again automatically."""
    def restore(checkpoint_id: str, **_: Any) -> Any:
        raise RestoreError("criu restore of job-1 failed: File has bad size")

    sink, lines = Published(), KeptLog()
    keeping = AutoRestorer(stored(tmp_path / "store"),
                           SimpleNamespace(restore=restore),  # type: ignore[arg-type]
                           lines, clock=lambda: 100.0, events=sink)
    guard = SimpleNamespace(name="/jobs", cgroup=None, spec=GuardConfig(cgroups=(),
                                                                         restore_attempts=2))
    keeping.restore(guard, "job-1")  # type: ignore[arg-type]
    assert keeping.store.get("job-1").restore_failures == 1 and not lines.seen
    keeping.restore(guard, "job-1")  # type: ignore[arg-type]
    error = {"error": "criu restore of job-1 failed: File has bad size"}
    assert sink.events[-1] == RestoreFailed("job-1", error, "/jobs", retry_in_s=None)
    [stuck] = lines.named("restore.stuck")
    assert stuck["attempts"] == 2 and stuck["reason"] == error["error"]
    meta = keeping.store.get("job-1")
    assert (meta.restore_failures, meta.stuck) == (2, error["error"])


# -- the control service --------------------------------------------------------------------------

def test_the_service_publishes_a_person_s_restore_and_its_failure(tmp_path: Path) -> None:
    result = RestoreResult(meta=make_meta("job-1"), pid=777, seconds=0.4)
    outcome: list[Any] = [result]

    def restore(checkpoint_id: str, **_: Any) -> Any:
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    service = Service(stored(tmp_path / "store"), restorer=SimpleNamespace(restore=restore),  # type: ignore[arg-type]
                      checkpointer=SimpleNamespace(), layout=NO_CGROUPS)  # type: ignore[arg-type]
    sink = Published()
    service.events = sink
    service.restore(0, "job-1")
    outcome[0] = RestoreError("no room")
    with pytest.raises(RestoreError):
        service.restore(0, "job-1")
    assert sink.events == [RestoreDone(result, requested_by=0),
                           RestoreFailed("job-1", {"error": "no room"}, "/jobs/a", uid=0,
                                         requested_by=0)]


def test_the_service_publishes_a_checkpoint_asked_for(tmp_path: Path) -> None:
    proc = ProcReader(fake_proc_tree(tmp_path / "proc", [FakeProc(500, 1, comm="job", uid=0)]))
    result = CheckpointResult(make_meta("c-2", uid=0), Path("/store/c-2"), TIMINGS)
    service = Service(stored(tmp_path / "store"), restorer=SimpleNamespace(),  # type: ignore[arg-type]
                      checkpointer=SimpleNamespace(checkpoint=lambda *a, **k: result),  # type: ignore[arg-type]
                      layout=NO_CGROUPS, proc=proc)
    service.checkpoint(0, 500)  # the CLI on the store itself: no sink, nothing told
    sink = Published()
    service.events = sink
    service.checkpoint(0, 500)
    assert sink.events == [CheckpointDone(result.meta, TIMINGS, requested_by=0)]


# -- the daemon's wiring --------------------------------------------------------------------------

def daemon(tmp_path: Path, **wiring: Any) -> Daemon:
    config = load_config_text(f'[daemon]\nstore = "{tmp_path / "store"}"\nnice = 0\n',
                              str(tmp_path / "oomguard.toml"))
    checkpointer = Checkpointer(Criu(binary="/nonexistent/criu", version=(4, 2)),
                                Store(config.store), SigstopFreezer())
    return Daemon(config, checkpointer, NO_CGROUPS, Lines(), poller=lambda: FakeEpoll(Clock()),
                  **wiring)


def test_the_daemon_hands_its_sink_to_every_site(tmp_path: Path) -> None:
    sink = Published()
    wired = daemon(tmp_path / "wired", events=sink)
    bare = daemon(tmp_path / "bare")  # a log and no sink: the lines alone, through that log
    try:
        assert wired.auto_restore.events is sink and wired.actor.events is sink
        assert wired.actor.runner.events is sink
        assert isinstance(bare.events, LogSink) and bare.events.log is bare.log
        assert bare.auto_restore.events is bare.events and bare.actor.runner.events is bare.events
    finally:
        wired.close()
        bare.close()
