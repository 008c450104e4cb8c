"""oomguard.observe.events: the typed events the daemon publishes, each with its log line (name,
level, fields as they have always been logged); the publisher (logsetup.RecordingLogger) that
writes the line from the event and hands the event to the tap, once; and EventTap handing each
typed event to the metrics, the hooks, D-Bus and Slurm (recorders stand in for the four
consumers; their own tests drive the real ones). Where the daemon makes them:
test_event_sites.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.daemon.telemetry import EventTap
from oomguard.lifecycle.checkpointrun import CheckpointTimings
from oomguard.lifecycle.restoreoutcome import RestoreResult
from oomguard.model.errors import FailedCheckpoint
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
from oomguard.observe.logsetup import RecordingLogger
from oomguard.sense.owners import SlurmStep
from tests.unit.test_store import make_meta

OWNER = {"scheduler": "slurm", "slurm_job_id": 42, "slurm_step": "batch", "slurm_uid": 1000}
META = make_meta("20261202-1-ab", image_bytes=356_000_000, rss_bytes=350_000_000,
                 extra={**OWNER, "ttys": [{"key": "x"}]})
TIMINGS = CheckpointTimings(freeze_s=0.01234, dump_s=1.23456, commit_s=0.05678, total_s=1.34567)
VICTIM = {"cgroup": "/sys/fs/cgroup/memory/jobs", "pid": 4242, "comm": "python3",
          "rss": 350_000_000, "tasks": 2, "reread_ms": 0.31}
BY_RULE = CheckpointDone(META, TIMINGS, VICTIM, "/var/lib/oomguard/20261202-1-ab", 123 << 20)
ON_REQUEST = CheckpointDone(META, TIMINGS, requested_by=0)
RESTORED = RestoreResult(meta=make_meta("job-1", restored_cgroup="/jobs/build"), pid=777,
                         seconds=0.123456, verify_s=0.0456, lazy=True, lazy_fallback=None,
                         warmed_bytes=6 << 20)
CRIU = {"error": "criu restore of job-1 failed", "criu_error": "Can't fork for 70: File exists"}


# -- each event's log line: the fields logged before the events were typed, in their order ---

LINES: list[tuple[Event, str, str, list[tuple[str, Any]]]] = [
    (BY_RULE, "warning", "checkpoint.done", [
        ("id", "20261202-1-ab"), ("image_bytes", 356_000_000), ("image", "339.5MiB"),
        ("seconds", 1.346), ("freeze_s", 0.012), ("dump_s", 1.235), ("commit_s", 0.057),
        ("mb_per_s", 288.4), ("usage_after", 123 << 20),
        ("path", "/var/lib/oomguard/20261202-1-ab"), ("uid", 1000),
        ("command", "python3 train.py --epochs 3"), ("restore", "oomguard restore 20261202-1-ab"),
        *OWNER.items(), *VICTIM.items()]),
    (ON_REQUEST, "warning", "checkpoint.done", [
        ("id", "20261202-1-ab"), ("pid", 4242), ("comm", "python3"), ("image_bytes", 356_000_000),
        ("rss", 350_000_000), ("uid", 1000), ("command", "python3 train.py --epochs 3"),
        ("requested_by", 0), ("restore", "oomguard restore 20261202-1-ab"), ("seconds", 1.346),
        ("freeze_s", 0.0123), ("dump_s", 1.2346), ("commit_s", 0.0568)]),
    (CheckpointFailed(FailedCheckpoint.THAWED, "CRIU: no space", VICTIM), "error",
     "checkpoint.failed", [("outcome", "thawed"), ("error", "CRIU: no space"), *VICTIM.items()]),
    (CheckpointRefused("store has 3 MiB free", VICTIM), "error", "checkpoint.refused",
     [("reason", "store has 3 MiB free"), *VICTIM.items()]),
    (RestoreDone(RESTORED, guard="/sys/fs/cgroup/memory/jobs"), "warning", "restore.done", [
        ("id", "job-1"), ("pid", 777), ("auto", True), ("cgroup", "/sys/fs/cgroup/memory/jobs"),
        ("seconds", 0.123), ("uid", 1000), ("command", "python3 train.py --epochs 3")]),
    (RestoreDone(RESTORED, requested_by=1000), "warning", "restore.done", [
        ("id", "job-1"), ("pid", 777), ("auto", False), ("seconds", 0.123), ("verify_s", 0.046),
        ("lazy", True), ("lazy_fallback", None), ("warmed_bytes", 6 << 20), ("uid", 1000),
        ("command", "python3 train.py --epochs 3"), ("cgroup", "/jobs/build"),
        ("requested_by", 1000)]),
    (RestoreFailed("job-1", CRIU, "/jobs/a", retry_in_s=60.0), "error", "restore.failed", [
        ("id", "job-1"), ("cgroup", "/jobs/a"), ("auto", True), ("retry_in_s", 60.0),
        *CRIU.items()]),
    (RestoreFailed("job-1", {"error": "no room"}, "/jobs/a", uid=1000, requested_by=0), "error",
     "restore.failed", [("id", "job-1"), ("auto", False), ("cgroup", "/jobs/a"), ("uid", 1000),
                        ("requested_by", 0), ("error", "no room")]),
    (VictimKilled("usage 950MiB >= 85% of 1GiB", 1, VICTIM), "error", "victim.killed", [
        ("reason", "usage 950MiB >= 85% of 1GiB"), ("sigkill", 1),
        ("explanation", "the rule's last action: no checkpoint was possible"), *VICTIM.items()]),
    (VictimFrozen(4.52, 0.8, {"freeze": "events", "forks_caught": 2}, VICTIM), "info",
     "victim.frozen", [("detect_to_frozen_ms", 4.52), ("choose_ms", 0.8), ("freeze", "events"),
                       ("forks_caught", 2), *VICTIM.items()]),
]


@pytest.mark.parametrize(("event", "level", "name", "fields"), LINES,
                         ids=[f"{line[2]}-{i}" for i, line in enumerate(LINES)])
def test_each_event_knows_its_log_line(event: Event, level: str, name: str,
                                       fields: list[tuple[str, Any]]) -> None:
    assert (event.level, event.name) == (level, name)
    assert list(event.log_fields().items()) == fields


def test_a_checkpoint_done_says_what_its_consumers_need() -> None:
    done = BY_RULE
    assert (done.id, done.pid, done.uid, done.command) == (
        "20261202-1-ab", 4242, 1000, "python3 train.py --epochs 3")
    assert (done.image_bytes, done.seconds, done.freed_bytes) == (356_000_000, 1.346,
                                                                  350_000_000)
    assert done.slurm == SlurmStep(42, "batch", 1000)
    assert done.reason == "memory"  # what Slurm's AdminComment has always said
    # The hook's environment: the log line's scalar fields (no None, no list).
    assert done.hook == {k: v for k, v in done.log_fields().items()
                         if isinstance(v, str | int | float | bool)}
    assert "pid" in done.hook and "slurm_job_id" in done.hook and "ttys" not in done.hook
    assert ON_REQUEST.slurm is None  # asked for over the socket: Slurm is not told


def test_an_unknown_owner_is_none_and_a_freeze_time_is_never_negative() -> None:
    assert CheckpointDone(make_meta(uid=-1), TIMINGS).uid is None
    assert RestoreDone(RestoreResult(meta=make_meta(uid=-1), pid=1, seconds=0.1)).uid is None
    assert VictimFrozen(4.5, 0.0).detect_to_frozen_s == pytest.approx(0.0045)
    assert VictimFrozen(-3.0, 0.0).detect_to_frozen_s == 0.0
    assert VictimKilled("why", 0, {"cgroup": "/jobs/a"}).pid == 0
    assert RestoreFailed("x", {}).error == ""


# -- the publisher --------------------------------------------------------------------------------

class BaseLog:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.calls.append(("line", level, event, fields))


@pytest.mark.parametrize(("event", "level", "name", "fields"), LINES,
                         ids=[f"{line[2]}-{i}" for i, line in enumerate(LINES)])
def test_the_publisher_taps_then_writes_the_line_once(event: Event, level: str, name: str,
                                                      fields: list[tuple[str, Any]]) -> None:
    calls: list[tuple[Any, ...]] = []
    log = RecordingLogger(BaseLog(calls), tap=lambda e: calls.append(("tap", e)))
    log.publish(event)
    assert calls == [("tap", event), ("line", level, name, dict(fields))]
    assert list(calls[1][3]) == [k for k, _ in fields]  # in that order
    [recent] = log.recent  # for `oomguard status`: scalars, not the path
    assert recent["event"] == name and recent["level"] == level
    assert {k: v for k, v in recent.items() if k not in ("time", "level", "event")} == {
        k: v for k, v in fields if isinstance(v, str | int | float | bool) and k != "path"}


def test_a_log_line_alone_reaches_no_consumer() -> None:
    """Only what is published goes on: a line is never read back into an event."""
    calls: list[tuple[Any, ...]] = []
    log = RecordingLogger(BaseLog(calls), tap=lambda e: calls.append(("tap", e)))
    log.warning("checkpoint.done", **BY_RULE.log_fields())
    log.error("restore.failed", id="x", auto=True, error="y")
    assert [c[0] for c in calls] == ["line", "line"]


def test_a_log_sink_writes_the_line_alone() -> None:
    calls: list[tuple[Any, ...]] = []
    LogSink(BaseLog(calls)).publish(ON_REQUEST)
    assert calls == [("line", "warning", "checkpoint.done", ON_REQUEST.log_fields())]


# -- the tap ----------------------------------------------------------------------------------------

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
    tap.tell(BY_RULE)
    assert metrics.calls == [("checkpoint_done", 356_000_000, 1.346, 350_000_000)]
    assert hooks.fired == [("on_checkpoint", BY_RULE.hook)]
    assert emitter.sent == [("checkpointed", 1000, "20261202-1-ab",
                             "python3 train.py --epochs 3", 4242)]
    assert slurm.done.wait(5)
    assert slurm.calls == [(42, "batch", "20261202-1-ab", "memory")]


def test_the_tap_counts_failures_refusals_kills_and_freezes() -> None:
    metrics, hooks, emitter = Metrics(), Hooks(), Emitter()
    tap = EventTap(metrics, hooks, emitter)  # type: ignore[arg-type]
    tap.tell(CheckpointFailed("thawed", "x"))
    tap.tell(CheckpointRefused("no room"))
    tap.tell(RestoreFailed("x", {"error": "y"}, retry_in_s=60.0))
    tap.tell(RestoreFailed("x", {"error": "y"}, requested_by=0))
    tap.tell(VictimFrozen(4.5, 0.1))
    assert metrics.calls == [("checkpoint_failed",), ("checkpoint_refused",),
                             ("restore", "failed", True), ("restore", "failed", False),
                             ("detection", pytest.approx(0.0045))]
    assert hooks.fired == [] and emitter.sent == []
    tap.tell(VictimKilled("why", 0, {"pid": 9}))
    assert metrics.calls[-1] == ("kill",)
    assert hooks.fired == [("on_kill", {"reason": "why", "sigkill": 0, "explanation":
                                        "the rule's last action: no checkpoint was possible",
                                        "pid": 9})]


def test_a_restore_goes_to_the_desktop_and_the_hook_and_counts_as_auto_or_not() -> None:
    metrics, hooks, emitter = Metrics(), Hooks(), Emitter()
    tap = EventTap(metrics, hooks, emitter)  # type: ignore[arg-type]
    auto = RestoreDone(RESTORED, guard="/jobs")
    tap.tell(auto)
    tap.tell(RestoreDone(RESTORED, requested_by=1000))
    assert metrics.calls == [("restore", "done", True), ("restore", "done", False)]
    assert emitter.sent == [("restored", 1000, "job-1", "python3 train.py --epochs 3", 777)] * 2
    assert hooks.fired[0] == ("on_restore", {"id": "job-1", "pid": 777, "auto": True,
                                             "cgroup": "/jobs", "seconds": 0.123, "uid": 1000,
                                             "command": "python3 train.py --epochs 3"})


def test_no_uid_no_desktop_signal_but_the_hook_still_runs() -> None:
    hooks, emitter = Hooks(), Emitter()
    tap = EventTap(None, hooks, emitter)  # type: ignore[arg-type]
    tap.tell(RestoreDone(RestoreResult(meta=make_meta("x", uid=-1), pid=7, seconds=0.5),
                         guard="/jobs"))
    assert emitter.sent == []
    assert [hook for hook, _ in hooks.fired] == ["on_restore"]


def test_the_daemon_s_publisher_feeds_the_tap() -> None:
    """As the daemon wires them (app.run_daemon): RecordingLogger(tap=EventTap.tell)."""
    metrics, hooks = Metrics(), Hooks()
    tap = EventTap(metrics, hooks)  # type: ignore[arg-type]
    calls: list[tuple[Any, ...]] = []
    log = RecordingLogger(BaseLog(calls), tap=tap.tell)
    log.publish(VictimKilled("why", 1, VICTIM))
    assert metrics.calls == [("kill",)] and [h for h, _ in hooks.fired] == ["on_kill"]
    assert [c[2] for c in calls] == ["victim.killed"]


def test_a_part_given_the_daemons_logger_publishes_to_it_without_being_told() -> None:
    """sink_for: the sink given, else the log where it is one (the daemon's RecordingLogger:
    a wiring that forgot `events` still feeds the metrics, hooks, D-Bus and Slurm), else the
    line alone."""
    from oomguard.observe.events import LogSink, sink_for
    from oomguard.observe.logsetup import RecordingLogger

    told: list[object] = []
    recording = RecordingLogger(SimpleNamespace(warning=lambda *a, **k: None,
                                                error=lambda *a, **k: None,
                                                info=lambda *a, **k: None), tap=told.append)
    assert sink_for(recording) is recording
    given = LogSink(None)
    assert sink_for(recording, given) is given
    plain = SimpleNamespace(info=lambda *a, **k: None)
    assert isinstance(sink_for(plain), LogSink) and sink_for(plain).log is plain  # type: ignore[attr-defined]
