"""A dry run's lasting decision is said once, then again when it changes or once a minute
(fake clock); the actor's victim.chosen goes through it, with the command line and RSS."""

from __future__ import annotations

from typing import Any

from oomguard.config.loading import GuardConfig
from oomguard.observe.decisionlog import REPEAT_EVERY, DecisionLog
from oomguard.policy.victims import ProcessTree
from oomguard.respond.actor import Actor, Request, rule_parts
from tests.unit._support import proc_info


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _add(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    info = warning = error = _add


def test_the_same_decision_is_said_once_then_once_a_minute() -> None:
    clock = Clock()
    log = DecisionLog(clock)
    said = []
    for _ in range(600):  # a minute of polls, ten a second
        said.append(log.due("system", "victim", 42))
        clock.now += 0.1
    assert said[0] == 0 and said[1:].count(None) == 599
    clock.now = 1000.0 + REPEAT_EVERY
    assert log.due("system", "victim", 42) == 599  # said again, with how often it went unsaid
    assert log.due("system", "victim", 42) is None


def test_another_decision_is_said_at_once() -> None:
    clock = Clock()
    log = DecisionLog(clock)
    assert log.due("system", "victim", 42) == 0
    assert log.due("system", "victim", 42) is None
    assert log.due("system", "victim", 43) == 0  # another victim
    assert log.due("system", "victim", 42) == 0  # and back
    assert log.due("system", "crossed", True) == 0  # another thing decided, its own line
    assert log.due("/jobs/a", "victim", 42) == 0  # another rule


def test_a_condition_over_makes_the_next_decision_news() -> None:
    log = DecisionLog(Clock())
    assert log.due("system", "victim", 42) == 0
    assert log.due("system", "crossed", True) == 0
    assert log.due("/jobs/a", "victim", 7) == 0
    log.forget("system")
    assert log.due("system", "victim", 42) == 0
    assert log.due("system", "crossed", True) == 0
    assert log.due("/jobs/a", "victim", 7) is None  # other rules keep theirs


def _request(trees: list[ProcessTree], actions: str = "checkpoint") -> Request:
    spec = GuardConfig(cgroups=("/jobs/a",), actions=())
    parts = rule_parts(spec if actions == "checkpoint" else
                       GuardConfig(cgroups=("/jobs/a",), on_failure="kill"))
    return Request("system", parts, 0.0, "MemAvailable 90MiB at or below 100MiB",
                   lambda: list(trees), lambda tree: None, lambda: True)


def test_a_dry_run_says_its_victim_once_until_it_changes() -> None:
    clock, log = Clock(), Log()
    actor = Actor(None, log, dry_run=True, clock=clock)  # type: ignore[arg-type]
    big = ProcessTree(proc_info(10, rss_mib=300), (proc_info(10, rss_mib=300),))
    small = ProcessTree(proc_info(11, rss_mib=20), (proc_info(11, rss_mib=20),))
    for _ in range(30):  # three seconds of polls
        actor._run(_request([big, small]), lambda: None)
        clock.now += 0.1
    chosen = [f for e, f in log.events if e == "victim.chosen"]
    assert len(chosen) == 1
    assert chosen[0]["pid"] == 10 and chosen[0]["command"] == "/bin/p10"
    assert chosen[0]["rss_mib"] == 300 and chosen[0]["dry_run"] is True
    assert chosen[0]["actions"] == ["checkpoint", "pageout"]
    assert "MemAvailable" in chosen[0]["reason"]
    actor._run(_request([small]), lambda: None)  # the big one is gone: another victim
    actor._run(_request([small], actions="checkpoint,kill"), lambda: None)  # another action
    actor._run(_request([small], actions="checkpoint,kill"), lambda: None)
    chosen = [f for e, f in log.events if e == "victim.chosen"]
    assert [(f["pid"], f["actions"]) for f in chosen] == [
        (10, ["checkpoint", "pageout"]), (11, ["checkpoint", "pageout"]),
        (11, ["checkpoint", "pageout", "kill"])]


def test_a_dry_run_with_no_victim_says_so_once() -> None:
    log = Log()
    actor = Actor(None, log, dry_run=True, clock=Clock())  # type: ignore[arg-type]
    for _ in range(10):
        actor._run(_request([]), lambda: None)
    assert [e for e, _ in log.events] == ["victim.none"]
