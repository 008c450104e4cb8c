"""The room lifted at a crossing (issue 26, the soak's last loss): from the choice of a victim
until it has stopped, the guarded cgroup's limit is lifted by the rule's headroom. A job that
writes its log through write(2) at the limit gets ENOMEM on cgroup v1 (its page faults would
wait there), and a 1000 MB/s job filled the last 20 MiB before its stop. The lift is released
once, when the victim is stopped (its dump's own lift takes over, its mates held), or when its
chain ends without a stop; it is never taken for an action on a limit left lifted, nor in a dry
run. The real lift and its ledger: tests/unit/test_lifts.py; the daemon's: the integration
tests of cgroup mates. Fakes from test_chain.py."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.act.actor import Actor, Request, RoomBridge, rule_parts
from oomguard.act.freezer import Frozen
from oomguard.config.loading import GuardConfig
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint
from tests.unit.test_chain import CHILD, REASON, ROOT, LogRecorder, make_rig, make_tree
from tests.unit.test_event_sites import Published


class Room:
    """hold_room's fake: what happened, in order, in `said` (shared with the checkpointer)."""

    def __init__(self, said: list[str], release_says: str | None = None,
                 lift: bool = True) -> None:
        self.said = said
        self.release_says = release_says
        self.lift = lift

    def __call__(self) -> Callable[[], str | None] | None:
        self.said.append("lift")
        if not self.lift:
            return None

        def release() -> str | None:
            self.said.append("release")
            return self.release_says
        return release


def request(room: Room, limit_busy: str = "") -> Request:
    return Request(name="/jobs", parts=rule_parts(GuardConfig(cgroups=("/jobs",))), woke=100.0,
                   reason=REASON, candidates=lambda: [make_tree(ROOT, CHILD)],
                   cgroup_for=lambda t: None, still_pressing=lambda: True,
                   limit_busy=limit_busy, hold_room=room)


def rig_saying(tmp_path: Path, said: list[str], *, stops: bool,
               error: Exception | None = None) -> Any:
    """A rig whose checkpoint says when it is called, and (`stops`) stops the tree first."""
    rig = make_rig(tmp_path, error=error)
    real = rig.checkpointer.checkpoint

    def checkpoint(tree: Any, cgroup: Any, reason: str,
                   on_frozen: Callable[[Frozen, float], None] | None = None, *,
                   headroom: int | None = None, after_signal: Callable[[], None] | None = None,
                   held: Collection[int] = ()) -> Any:
        said.append("checkpoint")
        if stops and on_frozen is not None:
            on_frozen(Frozen(pids=[ROOT, CHILD]), 100.5)
            said.append("dumped")
        real(tree, cgroup, reason, on_frozen, headroom=headroom, after_signal=after_signal,
             held=held)  # raises the rig's error
        return SimpleNamespace(meta=None, timings=None, path="/store/x")
    rig.checkpointer.checkpoint = checkpoint
    return rig


def test_the_room_is_lifted_before_the_victim_is_touched_and_given_back_once_it_stopped(
        tmp_path: Path) -> None:
    said: list[str] = []
    rig = rig_saying(tmp_path, said, stops=True)
    actor = Actor(rig.runner, LogRecorder(), dry_run=False, clock=lambda: 100.25)
    actor.events = Published()
    actor._run(request(Room(said)), lambda: None)
    # Lifted before the checkpoint began; given back when the tree had stopped, before the
    # dump went on (the dump's own lift holds what it needs); once, not again at the end.
    assert said == ["lift", "checkpoint", "release", "dumped"]
    frozen = actor.events.events[0]
    assert frozen.victim["room_lifted_ms"] == 250.0  # from the crossing's wake-up


@pytest.mark.parametrize("outcome", [FailedCheckpoint.UNTOUCHED, FailedCheckpoint.THAWED])
def test_a_chain_that_stops_nothing_gives_the_room_back_when_it_ends(
        tmp_path: Path, outcome: FailedCheckpoint) -> None:
    said: list[str] = []
    rig = rig_saying(tmp_path, said, stops=False,
                     error=CheckpointFailed("criu said no", outcome))
    log = LogRecorder()
    actor = Actor(rig.runner, log, dry_run=False, clock=lambda: 100.0)
    actor._run(request(Room(said, release_says="usage 300MiB > 256MiB")), lambda: None)
    # One victim tried (the other tree is too small to be worth it), then the room given back
    # once; a limit that cannot come back yet stays pending for the daemon's settling.
    assert said == ["lift", "checkpoint", "release"]


def test_no_room_is_lifted_for_a_limit_left_lifted_nor_in_a_dry_run(tmp_path: Path) -> None:
    said: list[str] = []
    rig = rig_saying(tmp_path, said, stops=True)
    busy = Actor(rig.runner, LogRecorder(), dry_run=False, clock=lambda: 100.0)
    busy.events = Published()
    busy._run(request(Room(said), limit_busy="usage above the limit"), lambda: None)
    assert "lift" not in said and "checkpoint" in said
    said.clear()
    dry = Actor(rig.runner, LogRecorder(), dry_run=True, clock=lambda: 100.0)
    dry._run(request(Room(said)), lambda: None)
    assert said == []


def test_nothing_is_lifted_when_no_victim_is_left(tmp_path: Path) -> None:
    said: list[str] = []
    rig = rig_saying(tmp_path, said, stops=True)
    actor = Actor(rig.runner, LogRecorder(), dry_run=False, clock=lambda: 100.0)
    empty = request(Room(said))
    empty.candidates = list
    actor._run(empty, lambda: None)
    assert said == []


def test_a_lift_that_fails_is_said_and_the_victim_is_still_taken(tmp_path: Path) -> None:
    said: list[str] = []
    rig = rig_saying(tmp_path, said, stops=True)
    log = LogRecorder()
    actor = Actor(rig.runner, log, dry_run=False, clock=lambda: 100.0)
    actor.events = Published()

    def refused() -> Callable[[], str | None] | None:
        raise PermissionError(13, "Permission denied")
    room_request = request(Room(said))
    room_request.hold_room = refused
    actor._run(room_request, lambda: None)
    assert "limit.lift_failed" in log.events and said == ["checkpoint", "dumped"]


def test_a_bridge_releases_once_and_a_none_release_is_nothing() -> None:
    calls: list[int] = []
    bridge = RoomBridge(lambda: calls.append(1) or None, 3.0)
    bridge.release()
    bridge.release()
    assert calls == [1] and bridge.lifted_ms == 3.0
    empty = RoomBridge(None, 3.0)
    empty.release()
    assert empty.lifted_ms is None
