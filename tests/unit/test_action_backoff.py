"""After an action that settled nothing (every chain ended thawed or refused), the rule waits
before it acts again, longer after each such action, and one that settles ends the wait: a
cgroup held at the guard's memory.high by a store over its budget was frozen, refused and
thawed ten times a second (found in the host lane). Fakes from test_chain.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.config.actions import CHECKPOINT, Step
from oomguard.config.loading import GuardConfig
from oomguard.model.errors import CheckpointFailed as CheckpointError
from oomguard.model.errors import FailedCheckpoint
from oomguard.policy.retry import MOST_RETRY, retry_delay
from oomguard.respond.actor import Actor, Request, rule_parts
from tests.unit.test_chain import CHILD, REASON, ROOT, LogRecorder, make_rig, make_tree
from tests.unit.test_event_sites import Published

BUDGET = ("checkpoint of 100 refused before stopping it: the store's budget has no room for "
          "a checkpoint of ~192.2MiB")


def test_the_wait_doubles_and_is_capped() -> None:
    assert retry_delay(0) == 0.0
    assert [retry_delay(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert retry_delay(9) == MOST_RETRY == retry_delay(10_000)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request() -> Request:
    spec = GuardConfig(cgroups=("/jobs",), actions=(Step(CHECKPOINT),))  # the checkpoint's own
    return Request(name="/jobs", parts=rule_parts(spec), woke=100.0,
                   reason=REASON, candidates=lambda: [make_tree(ROOT, CHILD)],
                   cgroup_for=lambda t: None, still_pressing=lambda: True)


@pytest.mark.parametrize("outcome", [FailedCheckpoint.UNTOUCHED, FailedCheckpoint.THAWED])
def test_a_rule_whose_action_settled_nothing_waits_longer_each_time(
        tmp_path: Path, outcome: FailedCheckpoint) -> None:
    rig = make_rig(tmp_path, error=CheckpointError(BUDGET, outcome))
    clock, log = Clock(), LogRecorder()
    actor = Actor(rig.runner, log, dry_run=False, clock=clock)
    assert actor.may_act("/jobs", 0.0, clock.now)
    waits = []
    for _ in range(3):
        actor._run(request(), lambda: None)
        _, said = log.records[-1][1:]
        assert log.records[-1][1] == "action.backoff"
        waits.append(said["retry_in_s"])
        retry = actor.retry_at("/jobs")
        assert retry is not None and retry == clock.now + said["retry_in_s"]
        assert not actor.may_act("/jobs", 0.0, retry - 0.01)  # not before its retry
        assert actor.may_act("/jobs", 0.0, retry, urgent=True)  # a limit left lifted: at once
        assert actor.may_act("/other", 0.0, clock.now)  # per rule
        clock.now = retry
        assert actor.may_act("/jobs", 0.0, clock.now)
    assert waits == [2.0, 4.0, 8.0]
    assert len(rig.checkpointer.calls) == 3  # one try per wait, not one per wake-up
    # The cause passed: the next action settles it, and the wait is gone.
    rig.checkpointer.error = None
    setattr(rig.checkpointer, "checkpoint",  # noqa: B010 (a fake's result for one call)
            lambda *a, **k: SimpleNamespace(meta=None, timings=None, path="/store/x"))
    actor.events = Published()
    actor._run(request(), lambda: None)
    assert len(actor.events.events) == 1  # its checkpoint.done
    assert actor.retry_at("/jobs") is None
    assert log.events.count("action.backoff") == 3
