"""oomguard.daemon.autorestore: a cgroup's oldest checkpoint is brought back only once it fits
under the threshold with its margin for `restore_quiet` without interruption, one at a time;
a failed one is retried only after RESTORE_BACKOFF, and a good one tells the keeper (its
listing is read again). A real Store; the restorer and the clock are the test's."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from oomguard.cgroup.base import MemorySnapshot
from oomguard.config.loading import GuardConfig
from oomguard.daemon.autorestore import RESTORE_BACKOFF, AutoRestorer
from oomguard.daemon.guards import CgroupGuard
from oomguard.lifecycle.restoreoutcome import RestoreResult
from oomguard.model.errors import RestoreFailed, RestoreInProgress
from tests.unit.test_restore_failures import meta_of, stored

MiB = 1 << 20
LIMIT = 256 * MiB


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((event, fields))


def guard_for(cgroup: str) -> CgroupGuard:
    rule = GuardConfig(cgroups=(cgroup,), restore_quiet=10.0)
    return CgroupGuard(spec=rule, cgroup=SimpleNamespace(  # type: ignore[arg-type]
        path=Path("/sys/fs/cgroup/memory" + cgroup), rel_path=cgroup))


def snap(usage: int) -> MemorySnapshot:
    return MemorySnapshot(usage_bytes=usage, limit_bytes=LIMIT, anon_bytes=usage,
                          file_bytes=0, oom_kills=0, under_oom=False)


class Restores:
    """The restorer: each call recorded; `fail` makes the next ones raise."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.fail: bool | str = False
        self.done = threading.Event()

    def restore(self, checkpoint_id: str, **_: Any) -> RestoreResult:
        self.asked.append(checkpoint_id)
        self.done.set()
        if self.fail == "raced":  # as Restorer.restore says it: its StoreError as the cause
            cause = RestoreInProgress(f"checkpoint {checkpoint_id} is being restored right now")
            raise RestoreFailed(str(cause)) from cause
        if self.fail:
            raise RestoreFailed("criu restore failed")
        return RestoreResult(meta=meta_of(checkpoint_id), pid=777, seconds=0.2)


def test_it_waits_for_room_and_quiet_then_restores_once(tmp_path: Path) -> None:
    store = stored(tmp_path / "store")
    cgroup = store.get("job-1").cgroup
    now = [100.0]
    restores, told = Restores(), []
    auto = AutoRestorer(store, restores, Log(), clock=lambda: now[0],  # type: ignore[arg-type]
                        restored=lambda: told.append("listing"))
    guard = guard_for(cgroup)
    auto.consider(guard, snap(250 * MiB))  # no room under the threshold: nothing
    assert guard.quiet_since is None and restores.asked == []
    auto.consider(guard, snap(1 * MiB))  # room: the quiet period begins
    assert guard.quiet_since == 100.0
    now[0] = 105.0
    auto.consider(guard, snap(1 * MiB))
    assert restores.asked == []  # 5 s of 10
    now[0] = 106.0
    auto.consider(guard, snap(250 * MiB))  # interrupted: begins again
    assert guard.quiet_since is None
    auto.consider(guard, snap(1 * MiB))
    now[0] = 116.0
    auto.consider(guard, snap(1 * MiB))
    assert restores.done.wait(10)
    assert auto._restoring is not None
    auto._restoring.join(10)
    assert restores.asked == ["job-1"] and told == ["listing"]


def test_a_failed_restore_waits_out_its_backoff(tmp_path: Path) -> None:
    store = stored(tmp_path / "store")
    guard = guard_for(store.get("job-1").cgroup)
    now = [100.0]
    restores = Restores()
    restores.fail = True
    auto = AutoRestorer(store, restores, Log(), clock=lambda: now[0])  # type: ignore[arg-type]
    auto.restore(guard, "job-1")  # said (restore.failed), retried later
    guard.quiet_since = 0.0  # quiet for long enough: only the backoff holds it back
    auto.consider(guard, snap(1 * MiB))
    assert restores.asked == ["job-1"] and guard.quiet_since is None
    now[0] = 100.0 + RESTORE_BACKOFF
    guard.quiet_since = 0.0
    auto.consider(guard, snap(1 * MiB))
    assert restores.done.wait(10)
    assert auto._restoring is not None
    auto._restoring.join(10)
    assert restores.asked == ["job-1", "job-1"]


def test_nothing_to_restore_without_a_restorer_or_a_checkpoint_of_that_cgroup(
        tmp_path: Path) -> None:
    store = stored(tmp_path / "store")
    guard = guard_for("/elsewhere")
    guard.quiet_since = 50.0
    AutoRestorer(store, Restores(), Log()).consider(guard, snap(0))  # type: ignore[arg-type]
    assert guard.quiet_since is None
    mine = guard_for(store.get("job-1").cgroup)
    mine.quiet_since = 50.0
    AutoRestorer(store, None, Log()).consider(mine, snap(0))
    assert mine.quiet_since is None


def test_a_race_lost_to_another_restore_is_no_failure_and_never_makes_it_stuck(
        tmp_path: Path) -> None:
    store = stored(tmp_path / "store")
    guard = guard_for(store.get("job-1").cgroup)
    restores, log = Restores(), Log()
    restores.fail = "raced"
    auto = AutoRestorer(store, restores, log, clock=lambda: 100.0)  # type: ignore[arg-type]
    for _ in range(guard.spec.restore_attempts + 2):
        auto.restore(guard, "job-1")
    meta = store.get("job-1")
    assert meta.restore_failures == 0 and not meta.stuck
    assert [event for event, _ in log.lines] == ["restore.raced"] * (guard.spec.restore_attempts + 2)
    assert auto._backoff["job-1"] == 100.0 + guard.spec.restore_retry  # looked at again later
