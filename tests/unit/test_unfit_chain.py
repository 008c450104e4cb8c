"""A tree no checkpoint can take while it lives (a traced task, a file CRIU cannot dump): the
chain says why once, with what comes next, and runs it; the tree is marked and no later
crossing chooses it again (the actor says so once). Fakes from test_chain.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from oomguard.config.actions import CHECKPOINT, Step
from oomguard.config.loading import GuardConfig
from oomguard.model.errors import CheckpointFailed as CheckpointError
from oomguard.model.errors import FailedCheckpoint
from oomguard.observe.events import CheckpointFailed, CheckpointRefused, VictimKilled
from oomguard.policy.unfit import UnfitMarks
from oomguard.policy.victims import ProcessTree
from oomguard.respond.actor import Actor, Request, rule_parts
from oomguard.respond.chain import ChainOutcome, ChainResult
from oomguard.respond.chainstate import ChainRun, Settled, StepResult
from tests.unit.test_chain import (
    CHILD,
    FIELDS,
    REASON,
    ROOT,
    LogRecorder,
    Rig,
    chain,
    make_rig,
    make_tree,
    run,
)
from tests.unit.test_event_sites import Published

TRACED = f"pid {CHILD} (p{CHILD}) is traced by pid {ROOT} (strace): CRIU cannot dump a traced task"
NEXT_VICTIM = ("the next victim, if one is worth it; this tree runs on and is never chosen "
               "again while it lives")


def unfit_tree() -> ProcessTree:
    return dataclasses.replace(make_tree(ROOT, CHILD), unfit=TRACED)


def refused(tmp_path: Path) -> tuple[Rig, Published]:
    rig = make_rig(tmp_path, error=CheckpointError(f"checkpoint of {ROOT} refused before "
                                                   f"stopping it: {TRACED}",
                                                   FailedCheckpoint.UNTOUCHED, lasting=TRACED))
    rig.runner.marks = UnfitMarks(lambda pid: 1000)
    sink = Published()
    rig.runner.events = sink
    return rig, sink


def test_a_tree_unfit_before_the_freeze_is_refused_once_then_killed_with_why(
        tmp_path: Path) -> None:
    rig, sink = refused(tmp_path)
    outcome = run(rig, chain("checkpoint", "kill"), unfit_tree())
    assert outcome.result is ChainResult.KILLED
    assert sink.events == [
        CheckpointRefused(TRACED, {**FIELDS, "lasting": True, "then": "kill"}),
        VictimKilled(REASON, 0, {**FIELDS, "not_checkpointed": TRACED})]
    assert rig.runner.marks.reason(unfit_tree()) == TRACED
    assert rig.freezer.froze == []  # nothing was stopped


def test_without_a_next_step_it_is_left_running_and_said_so(tmp_path: Path) -> None:
    rig, sink = refused(tmp_path)
    outcome = run(rig, chain("checkpoint"), unfit_tree())
    assert outcome.result is ChainResult.THAWED and not outcome.settled
    assert sink.events == [
        CheckpointRefused(TRACED, {**FIELDS, "lasting": True, "then": NEXT_VICTIM})]


def test_a_lasting_criu_failure_marks_the_tree_and_says_why(tmp_path: Path) -> None:
    why = "an open file of a kind CRIU cannot dump (fd 3: anon anon_inode:[perf_event])"
    rig = make_rig(tmp_path, error=CheckpointError("checkpoint of 1 failed: criu dump exited "
                                                   "with status 1\n...", FailedCheckpoint.THAWED,
                                                   lasting=why))
    rig.runner.marks = UnfitMarks(lambda pid: 1000)
    sink = Published()
    rig.runner.events = sink
    tree = make_tree(ROOT, CHILD)
    outcome = run(rig, chain("checkpoint", "kill"), tree)
    assert outcome.result is ChainResult.KILLED
    [failed, killed] = sink.events
    assert failed == CheckpointFailed(FailedCheckpoint.THAWED, "checkpoint of 1 failed: criu "
                                      "dump exited with status 1\n...",
                                      {**FIELDS, "lasting": True, "then": "kill", "why": why})
    assert killed == VictimKilled(REASON, 0, {**FIELDS, "not_checkpointed": why})
    # Nothing before a dump can tell: marked for as long as the root lives.
    assert rig.runner.marks.reason(tree) == why


def test_a_failure_that_may_pass_marks_nothing(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, error=CheckpointError("criu dump timed out",
                                                   FailedCheckpoint.THAWED))
    rig.runner.marks = UnfitMarks(lambda pid: 1000)
    run(rig, chain("checkpoint"), make_tree(ROOT, CHILD))
    assert len(rig.runner.marks) == 0


def test_the_actor_never_chooses_a_marked_tree_again_and_says_so_once(tmp_path: Path) -> None:
    rig, sink = refused(tmp_path)
    log = LogRecorder()
    actor = Actor(rig.runner, log, dry_run=False, clock=lambda: 10.0)
    trees = [unfit_tree()]
    spec = GuardConfig(cgroups=("/jobs",), actions=(Step(CHECKPOINT),))
    request = Request(name="/jobs", parts=rule_parts(spec),
                      woke=10.0, reason=REASON, candidates=lambda: list(trees),
                      cgroup_for=lambda t: None, still_pressing=lambda: True)
    actor._run(request, lambda: None)
    assert len(rig.checkpointer.calls) == 1
    assert not actor.left_alone("/jobs")
    for _ in range(5):  # the crossings that follow: not tried, said once
        actor._run(request, lambda: None)
    assert len(rig.checkpointer.calls) == 1
    assert [e for e in log.events if e == "victim.none"] == ["victim.none"]
    _, said = log.find("victim.none")
    assert said["unfit"] == [f"pid {ROOT} (p{ROOT}): {TRACED}"]
    assert actor.left_alone("/jobs")
    assert len(sink.events) == 1  # the refusal, once
    # Another job grows: it is a candidate (and the marked tree still is not).
    other = make_tree(ROOT + 50)
    trees.append(other)
    rig.checkpointer.error = CheckpointError("criu dump timed out", FailedCheckpoint.THAWED)
    actor._run(request, lambda: None)
    assert [c["tree"].root.pid for c in rig.checkpointer.calls] == [ROOT, ROOT + 50]
    assert not actor.left_alone("/jobs")


class PagesOut:
    """The pageout step, recording what it was given (its real parts: test_pageout_real.py)."""

    def __init__(self) -> None:
        self.trees: list[int] = []

    def run(self, step: Step, chain_run: ChainRun) -> StepResult:
        self.trees.append(chain_run.tree.root.pid)
        return Settled(ChainOutcome(ChainResult.PAGED_OUT, str(step), "paged out"))


def test_a_chain_that_pages_out_takes_a_marked_tree_again_past_its_checkpoint(
        tmp_path: Path) -> None:
    """Paged out, then continued, a tree CRIU cannot dump that grows again is paged out
    again: never left to the kernel's OOM killer for having been refused once. Its
    checkpoint step refuses it at once, without asking CRIU again; unmarked trees still
    come first."""
    rig, sink = refused(tmp_path)
    pager = PagesOut()
    rig.runner.actions["pageout"] = pager
    actor = Actor(rig.runner, LogRecorder(), dry_run=False, clock=lambda: 10.0)
    trees = [unfit_tree()]
    config = GuardConfig(cgroups=("/jobs",), actions=chain("checkpoint", "pageout"))
    request = Request(name="/jobs", parts=rule_parts(config), woke=10.0, reason=REASON,
                      candidates=lambda: list(trees), cgroup_for=lambda t: None,
                      still_pressing=lambda: True)
    for _ in range(3):
        actor._run(request, lambda: None)
    assert pager.trees == [ROOT] * 3
    assert len(rig.checkpointer.calls) == 1  # CRIU was asked once
    refusals = [e for e in sink.events if isinstance(e, CheckpointRefused)]
    assert [(r.victim["pid"], r.victim["then"]) for r in refusals] == [(ROOT, "pageout")] * 3
    assert refusals[0].reason == TRACED
    assert [r.reason for r in refusals[1:]] == \
        [f"refused before, for as long as it lives: {TRACED}"] * 2
    assert not actor.left_alone("/jobs")
    other = make_tree(ROOT + 50)
    trees.append(other)
    rig.checkpointer.error = CheckpointError("criu dump timed out", FailedCheckpoint.THAWED)
    actor._run(request, lambda: None)  # a tree CRIU may take comes before the marked one
    assert [c["tree"].root.pid for c in rig.checkpointer.calls] == [ROOT, ROOT + 50]
    assert pager.trees == [ROOT, ROOT, ROOT, ROOT + 50]
