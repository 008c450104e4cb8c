"""Restore guards: the fit under a guard's threshold (one arithmetic with auto-restore), the
daemon's rule lookup, `restore --wait`, and the service's refusals and restore.failed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oomguard.cgroup.base import MemorySnapshot
from oomguard.cgroup.mounts import CgroupLayout
from oomguard.cli.main import main
from oomguard.cli.restorewait import restore_when_it_fits
from oomguard.config.loading import GuardConfig
from oomguard.control.client import ControlError
from oomguard.control.server import dispatch
from oomguard.control.service import Service
from oomguard.daemon.guards import CgroupGuard, SystemGuard, daemon_lookup
from oomguard.daemon.telemetry import EventTap
from oomguard.lifecycle.restorefit import RestoreGuard, check_fits, guard_for
from oomguard.model.errors import NoRoom, RestoreFailed
from oomguard.observe.events import LogSink
from oomguard.observe.events import RestoreFailed as RestoreFailedEvent
from oomguard.observe.metrics import Metrics
from oomguard.policy.pressure import free_under_threshold, restore_fits
from oomguard.store.checkpoints import CheckpointMeta, Store

MiB = 1 << 20
GiB = 1 << 30
NO_CGROUPS = CgroupLayout(memory_v1=None, unified=None, unified_controllers=())


def snap(usage: int, limit: int | None) -> MemorySnapshot:
    return MemorySnapshot(usage_bytes=usage, limit_bytes=limit, anon_bytes=usage, file_bytes=0,
                          oom_kills=0, under_oom=False)


def fake_cgroup(path: str, snapshot: MemorySnapshot | None = None) -> Any:
    return SimpleNamespace(path=Path(path), rel_path=path, snapshot=lambda: snapshot)


# -- the arithmetic ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("usage", "limit", "threshold", "free"),
    [(0, None, 0.85, None),
     (0, 400 * MiB, 0.85, 340 * MiB),
     (100 * MiB, 400 * MiB, 0.85, 240 * MiB),
     (390 * MiB, 400 * MiB, 0.85, -50 * MiB),  # over the threshold
     (0, 1000, 0.8, 800), (1, 1000, 0.8, 799)],
)
def test_free_under_threshold(usage: int, limit: int | None, threshold: float,
                              free: int | None) -> None:
    assert free_under_threshold(snap(usage, limit), threshold) == free


def test_the_issue_case_is_refused_with_figures_and_both_ways_out() -> None:
    """A 352 MiB job back into a 400 MiB cgroup that acts at 85% (340 MiB)."""
    guard = RestoreGuard(Path("/cg/jobs"), 0.85, 64 * MiB)
    with pytest.raises(NoRoom) as refused:
        check_fits("job-1", fake_cgroup("/cg/jobs"), snap(0, 400 * MiB), 352 * MiB, guard)
    text = str(refused.value)
    assert "\n" not in text
    assert "its guard acts at 85% of 400 MiB, 340 MiB are free under that" in text
    assert "needs 352 MiB + 64 MiB margin" in text
    assert "--cgroup PATH" in text and "--wait" in text and "--force" in text
    assert isinstance(refused.value, RestoreFailed)  # every caller of a restore handles it


@pytest.mark.parametrize("usage", [0, 10 * MiB, 200 * MiB, 500 * MiB])
@pytest.mark.parametrize("limit", [None, 256 * MiB, 400 * MiB, GiB])
@pytest.mark.parametrize("image", [0, 100 * MiB, 352 * MiB])
def test_the_cli_check_and_auto_restore_agree(usage: int, limit: int | None, image: int) -> None:
    """One rule for both: check_fits refuses exactly when restore_fits says no."""
    guard = RestoreGuard(Path("/cg"), 0.85, 64 * MiB)
    fits = restore_fits(snap(usage, limit), image, guard.margin, guard.threshold)
    try:
        check_fits("x", fake_cgroup("/cg"), snap(usage, limit), image, guard)
        refused = False
    except NoRoom:
        refused = True
    assert refused is not fits


def test_the_lookup_follows_the_daemons_current_rules() -> None:
    rules: list[Any] = []
    lookup = daemon_lookup(lambda: rules)
    jobs = fake_cgroup("/cg/jobs")
    assert lookup(jobs) is None
    spec = GuardConfig(cgroups=("/cg/jobs",), threshold=0.7, restore_margin=32 * MiB)
    rules.append(SystemGuard(spec=GuardConfig(cgroups=(), system=True)))
    rules.append(CgroupGuard(spec=spec, cgroup=jobs))
    assert lookup(jobs) == RestoreGuard(Path("/cg/jobs"), 0.7, 32 * MiB)
    assert lookup(fake_cgroup("/cg/jobs/child")) is None  # only the guarded directory itself
    rules.clear()  # a reload dropped the rule
    assert lookup(jobs) is None
    assert guard_for(jobs, []) is None


# -- restore --wait ------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def attempts(*outcomes: Exception | dict[str, Any]) -> tuple[Any, list[int]]:
    calls: list[int] = []

    def attempt() -> dict[str, Any]:
        outcome = outcomes[min(len(calls), len(outcomes) - 1)]
        calls.append(1)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    return attempt, calls


NO_ROOM_REMOTE = ControlError("io.oomguard.NoRoom", "no room now")


def test_wait_asks_again_until_it_fits_and_tells_once() -> None:
    clock, told = Clock(), list[str]()
    attempt, calls = attempts(NoRoom("no room"), NO_ROOM_REMOTE, NO_ROOM_REMOTE, {"pid": 7})
    result = restore_when_it_fits(attempt, wait=True, timeout=None, tell=told.append,
                                  clock=clock, sleep=clock.sleep)
    assert result == {"pid": 7} and len(calls) == 4
    assert told == ["no room\nwaiting until it fits (Ctrl-C to give up)"]
    assert clock.now == 6.0


def test_wait_gives_up_at_the_timeout_and_the_reason_says_why() -> None:
    clock, told = Clock(), list[str]()
    attempt, calls = attempts(NO_ROOM_REMOTE)
    with pytest.raises(RestoreFailed, match=r"gave up after waiting 5s: no room now"):
        restore_when_it_fits(attempt, wait=True, timeout=5, tell=told.append, clock=clock,
                             sleep=clock.sleep)
    assert len(calls) == 4  # at 0, 2, 4 and 6 s
    assert told[0].endswith("(Ctrl-C to give up, at most 5s)")


def test_ctrl_c_while_waiting_says_the_checkpoint_is_untouched() -> None:
    told: list[str] = []

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    attempt, calls = attempts(NO_ROOM_REMOTE)
    with pytest.raises(KeyboardInterrupt):
        restore_when_it_fits(attempt, wait=True, timeout=None, tell=told.append,
                             sleep=interrupted)
    assert len(calls) == 1
    assert told[-1] == "gave up waiting; the checkpoint is untouched"


@pytest.mark.parametrize("error", [NoRoom("no room"), NO_ROOM_REMOTE])
def test_without_wait_no_room_is_raised_at_once(error: Exception) -> None:
    attempt, calls = attempts(error)
    with pytest.raises(type(error)):
        restore_when_it_fits(attempt, wait=False, timeout=None, tell=print)
    assert len(calls) == 1


@pytest.mark.parametrize("error", [RestoreFailed("criu restore failed"),
                                   ControlError("io.oomguard.Failed", "pid in use")])
def test_wait_does_not_retry_other_failures(error: Exception) -> None:
    attempt, calls = attempts(error)
    with pytest.raises(type(error)):
        restore_when_it_fits(attempt, wait=True, timeout=None, tell=print)
    assert len(calls) == 1


# -- the service --------------------------------------------------------------------------------

def meta_of(checkpoint_id: str, cgroup: str = "/jobs/a") -> CheckpointMeta:
    return CheckpointMeta(id=checkpoint_id, pid=70, pids=[70], command="job", comm="job", uid=0,
                          user="root", cgroup=cgroup, cgroup_version=1, rss_bytes=100 * MiB,
                          reason="test", criu_version="4.2", created=1_700_000_000.0)


@pytest.fixture
def service(tmp_path: Path) -> Service:
    store = Store(tmp_path / "store")
    meta = meta_of("job-1")
    images, lock_fd = store.begin(meta)
    os.close(lock_fd)
    (images / "pages-1.img").write_bytes(b"\0" * 4096)
    store.commit(meta)
    return Service(store, restorer=SimpleNamespace(), checkpointer=SimpleNamespace(),  # type: ignore[arg-type]
                   layout=NO_CGROUPS)


def call(service: Service, method: str, **parameters: Any) -> dict[str, Any]:
    raw = json.dumps({"method": f"io.oomguard.{method}", "parameters": parameters}).encode()
    return dispatch(service, raw, 0, 1234)[1]


def test_a_failed_restore_is_told_to_the_daemon_with_its_reason(service: Service) -> None:
    failures: list[tuple[str, dict[str, Any]]] = []
    told = SimpleNamespace(error=lambda event, **fields: failures.append((event, fields)))
    service.events = LogSink(told)  # the lines the daemon logs

    def restore(checkpoint_id: str, **_: Any) -> Any:
        raise RestoreFailed("criu restore of job-1 failed; the checkpoint is intact: "
                            "criu restore exited with status 1: Can't fork for 70: File exists")

    service.restorer = SimpleNamespace(restore=restore)  # type: ignore[assignment]
    reply = call(service, "Restore", id="job-1")
    assert reply["error"] == "io.oomguard.Failed"
    assert "Can't fork for 70" in reply["parameters"]["message"]
    assert [(e, f["id"], f["auto"], f["requested_by"]) for e, f in failures] == [
        ("restore.failed", "job-1", False, 0)]
    assert "Can't fork for 70" in failures[0][1]["error"]


def test_no_room_has_its_own_error_name(service: Service) -> None:
    def restore(checkpoint_id: str, **_: Any) -> Any:
        raise NoRoom("target cgroup /x has 1 MiB free under its limit")

    service.restorer = SimpleNamespace(restore=restore)  # type: ignore[assignment]
    reply = call(service, "Restore", id="job-1")
    assert reply["error"] == "io.oomguard.NoRoom"


def test_the_guard_check_uses_the_target_and_force_skips_it(service: Service) -> None:
    full = fake_cgroup("/cg/jobs", snap(300 * MiB, 400 * MiB))
    service.guard_of = lambda cgroup: RestoreGuard(cgroup.path, 0.85, 64 * MiB)
    with pytest.raises(NoRoom, match="40 MiB are free under that"):
        service._check_guard(service.store.get("job-1"), full)
    service._check_guard(service.store.get("job-1"), None)  # no target cgroup: nothing to check
    service.guard_of = lambda cgroup: None
    service._check_guard(service.store.get("job-1"), full)  # not guarded: the limit check only


def test_restore_failed_events_count_in_the_metric() -> None:
    metrics = Metrics()
    tap = EventTap(metrics)
    tap.tell(RestoreFailedEvent("job-1", {"error": "no room"}, requested_by=0))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(metrics.render().decode())
              for s in family.samples if s.name == "oomguard_restores_total"}
    assert values[("oomguard_restores_total", (("auto", "false"), ("outcome", "failed")))] == 1
    assert values[("oomguard_restores_total", (("auto", "false"), ("outcome", "done")))] == 0


def test_timeout_without_wait_is_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--log-format", "json", "restore", "some-id", "--timeout", "5s"]) == 2
    assert "--timeout goes with --wait" in capsys.readouterr().err
