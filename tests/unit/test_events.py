"""oomguard.observe.events: the log events that feed more than the log, read into types once,
and EventTap handing each typed event to the metrics, the hooks, D-Bus and Slurm (recorders
stand in for the four consumers; their own tests drive the real ones)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from oomguard.observe.events import (
    CheckpointDone,
    CheckpointFailed,
    CheckpointRefused,
    RestoreDone,
    RestoreFailed,
    VictimFrozen,
    VictimKilled,
    typed,
)
from oomguard.observe.telemetry import EventTap
from oomguard.sense.owners import SlurmStep

DONE = {"id": "20261202-1-ab", "pid": 4242, "uid": 1000, "command": "python3 train.py",
        "reason": "resident 340 MiB >= 85% of 400 MiB", "image_bytes": 356_000_000,
        "seconds": 1.5, "rss": 350_000_000, "cgroup": "/sys/fs/cgroup/memory/jobs",
        "scheduler": "slurm", "slurm_job_id": 42, "slurm_step": "batch", "slurm_uid": 1000,
        "timings": {"dump": 1.2}}


def test_a_checkpoint_done_reads_every_field_a_consumer_needs() -> None:
    done = typed("checkpoint.done", DONE)
    assert done == CheckpointDone(
        id="20261202-1-ab", pid=4242, uid=1000, command="python3 train.py",
        reason="resident 340 MiB >= 85% of 400 MiB", image_bytes=356_000_000, seconds=1.5,
        freed_bytes=350_000_000, slurm=SlurmStep(42, "batch", 1000),
        hook={k: v for k, v in DONE.items() if k != "timings"})  # scalars only


@pytest.mark.parametrize(("event", "fields", "expected"), [
    ("checkpoint.failed", {"outcome": "thawed", "error": "CRIU: no space"},
     CheckpointFailed("thawed", "CRIU: no space")),
    ("checkpoint.refused", {"reason": "store has 3 MiB free"},
     CheckpointRefused("store has 3 MiB free")),
    ("restore.done", {"id": "x", "pid": 7, "uid": 0, "command": "sleep", "auto": True},
     RestoreDone("x", 7, 0, "sleep", True, {"id": "x", "pid": 7, "uid": 0,
                                            "command": "sleep", "auto": True})),
    ("restore.failed", {"id": "x", "error": "Error (criu/files.c:1): bad size"},
     RestoreFailed("x", False, "Error (criu/files.c:1): bad size")),
    ("victim.killed", {"pid": 9}, VictimKilled(9, {"pid": 9})),
    ("victim.frozen", {"detect_to_frozen_ms": 4.5}, VictimFrozen(0.0045)),
    ("victim.frozen", {}, VictimFrozen(None)),
])
def test_each_event_that_feeds_more_than_the_log(event: str, fields: dict[str, Any],
                                                 expected: object) -> None:
    assert typed(event, fields) == expected


@pytest.mark.parametrize("event", ["guard.armed", "threshold.crossed", "victim.chosen",
                                   "checkpoint.started", "control.call"])
def test_events_only_for_the_log_are_not_typed(event: str) -> None:
    assert typed(event, DONE) is None


def test_fields_of_the_wrong_kind_read_as_unknown_not_as_a_crash() -> None:
    done = typed("checkpoint.done", {"id": "x", "pid": "?", "uid": True, "image_bytes": None,
                                     "seconds": "slow", "rss": -5, "scheduler": "slurm",
                                     "slurm_job_id": "nope"})
    assert isinstance(done, CheckpointDone)
    assert (done.pid, done.uid, done.image_bytes, done.seconds, done.freed_bytes, done.slurm) \
        == (0, None, 0, 0.0, 0, None)
    assert done.reason == "memory"  # what Slurm's AdminComment says when none was given


class Metrics:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, *args))


class Hooks:
    def __init__(self) -> None:
        self.fired: list[tuple[str, dict[str, Any]]] = []

    def fire(self, hook: str, fields: Any) -> None:
        self.fired.append((hook, dict(fields)))


class Emitter:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, str, str, int]] = []

    def emit_checkpointed(self, uid: int, cid: str, command: str, pid: int) -> bool:
        self.sent.append(("checkpointed", uid, cid, command, pid))
        return True

    def emit_restored(self, uid: int, cid: str, command: str, pid: int) -> bool:
        self.sent.append(("restored", uid, cid, command, pid))
        return True


class Slurm:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None, str, str]] = []
        self.done = threading.Event()

    def notify(self, job_id: int, step: str | None, cid: str, when: float, reason: str) -> str:
        self.calls.append((job_id, step, cid, reason))
        self.done.set()
        return "requeued"


def test_the_tap_hands_a_checkpoint_to_all_four() -> None:
    metrics, hooks, emitter, slurm = Metrics(), Hooks(), Emitter(), Slurm()
    tap = EventTap(metrics, hooks, emitter, slurm)  # type: ignore[arg-type]
    tap("warning", "checkpoint.done", DONE)
    assert metrics.calls == [("checkpoint_done", 356_000_000, 1.5, 350_000_000)]
    assert hooks.fired == [("on_checkpoint", {k: v for k, v in DONE.items()
                                              if k != "timings"})]
    assert emitter.sent == [("checkpointed", 1000, "20261202-1-ab", "python3 train.py", 4242)]
    assert slurm.done.wait(5)
    assert slurm.calls == [(42, "batch", "20261202-1-ab", "resident 340 MiB >= 85% of 400 MiB")]


def test_the_tap_counts_failures_and_tells_no_one_else() -> None:
    metrics, hooks, emitter = Metrics(), Hooks(), Emitter()
    tap = EventTap(metrics, hooks, emitter)  # type: ignore[arg-type]
    tap("error", "checkpoint.failed", {"outcome": "thawed", "error": "x"})
    tap("error", "restore.failed", {"id": "x", "auto": True, "error": "y"})
    tap("info", "guard.armed", {"cgroup": "/x"})
    assert metrics.calls == [("checkpoint_failed",), ("restore", "failed", True)]
    assert hooks.fired == [] and emitter.sent == []


def test_no_uid_no_desktop_signal_but_the_hook_still_runs() -> None:
    hooks, emitter = Hooks(), Emitter()
    tap = EventTap(None, hooks, emitter)  # type: ignore[arg-type]
    tap("info", "restore.done", {"id": "x", "pid": 7, "command": "sleep"})
    assert emitter.sent == []
    assert hooks.fired == [("on_restore", {"id": "x", "pid": 7, "command": "sleep"})]
