"""StoreUpkeep on a real store in a temporary directory, with a fake clock: what a crashed run
left (partials being written, finished, failed), retention, and what it logs once."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path
from typing import Any

from oomguard.config.loading import DaemonConfig
from oomguard.daemon.storeupkeep import PRUNE_INTERVAL, StoreUpkeep
from oomguard.store.checkpoints import CheckpointMeta, Store
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import FROZEN_LEDGER


class RecordingLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _add(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    info = warning = error = debug = _add

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.events if name == event]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def meta(checkpoint_id: str, created: float = 1_700_000_000.0) -> CheckpointMeta:
    return CheckpointMeta(id=checkpoint_id, pid=4242, pids=[4242], command="python3 train.py",
                          comm="python3", uid=0, user="root", cgroup="/jobs/a",
                          cgroup_version=1, rss_bytes=1 << 20, reason="test",
                          criu_version="4.2.1", created=created)


def upkeep(tmp_path: Path, **config: Any) -> tuple[StoreUpkeep, Store, RecordingLog, FakeClock]:
    store = Store(tmp_path / "store")
    store.ensure()
    log, clock = RecordingLog(), FakeClock()
    ledger = FrozenLedger(tmp_path / "store" / FROZEN_LEDGER)
    settings = dataclasses.replace(DaemonConfig(source="test"), store=str(store.root),
                                   **config)
    return StoreUpkeep(store, ledger, settings, log, clock=clock,
                       wall_clock=lambda: 1_700_000_000.0 + 3600), store, log, clock


def committed(store: Store, checkpoint_id: str, created: float = 1_700_000_000.0,
              state: str = "checkpointed") -> None:
    images, fd = store.begin(meta(checkpoint_id, created))
    (images / "pages-1.img").write_bytes(b"x" * 4096)
    os.close(fd)
    store.commit(meta(checkpoint_id, created))
    if state != "checkpointed":
        stored = store.get(checkpoint_id)
        stored.state = state
        store.update(stored)


def test_a_partial_still_written_is_logged_once_and_settled_when_its_writer_is_done(
        tmp_path: Path) -> None:
    keep, store, log, clock = upkeep(tmp_path)
    images, lock_fd = store.begin(meta("20261202-000509-274-a11e"))  # a CRIU at work holds it
    keep.recover_store()
    for _ in range(5):  # the rescans while it writes
        clock.now += 0.1
        assert keep.tick() is True  # something waits: asked again soon
    assert len(log.named("checkpoint.partial_busy")) == 1
    assert (images.parent).is_dir()
    fcntl.flock(lock_fd, fcntl.LOCK_UN)
    os.close(lock_fd)  # its dump failed (no success line in dump.log): CRIU resumed the tree
    assert keep.tick() is False
    assert [f["id"] for f in log.named("checkpoint.partial_removed")] == \
        ["20261202-000509-274-a11e"]
    assert not images.parent.exists()


def test_a_finished_dump_of_a_dead_run_is_committed_not_deleted(tmp_path: Path) -> None:
    keep, store, log, _clock = upkeep(tmp_path)
    checkpoint_id = "20261202-010000-100-beef"
    images, fd = store.begin(meta(checkpoint_id))
    (images / "pages-1.img").write_bytes(b"y" * 8192)
    (images / "dump.log").write_text("(00.5) Dumping finished successfully\n")
    os.close(fd)  # the run that wrote it died here
    keep.recover_store()
    assert [f["id"] for f in log.named("checkpoint.recovered")] == [checkpoint_id]
    [listed] = store.list()
    assert listed.id == checkpoint_id and listed.state == "checkpointed"
    assert listed.extra.get("recovered") is True
    store.verify(checkpoint_id)  # checksummed at the recovery's commit


def test_pruning_by_age_takes_restored_checkpoints_only_every_prune_interval(
        tmp_path: Path) -> None:
    """max_age alone never deletes a checkpoint that was not restored (it is all of its job)."""
    keep, store, log, clock = upkeep(tmp_path, store_max_age=1800.0)
    old = 1_700_000_000.0  # an hour before the wall clock
    committed(store, "20261202-010000-101-0001", created=old, state="restored")
    committed(store, "20261202-010000-102-0002", created=old)  # old, never restored: kept
    committed(store, "20261202-010000-103-0003", created=old + 3500, state="restored")  # recent
    keep.recover_store()
    keep.tick()
    assert [m.id for m in store.list()] == ["20261202-010000-102-0002",
                                            "20261202-010000-103-0003"]
    committed(store, "20261202-010000-104-0004", created=old, state="restored")
    clock.now += PRUNE_INTERVAL / 2
    keep.tick()  # not due yet
    assert len(store.list()) == 3
    clock.now += PRUNE_INTERVAL
    keep.tick()
    assert [m.id for m in store.list()] == ["20261202-010000-102-0002",
                                            "20261202-010000-103-0003"]
    assert [f["id"] for f in log.named("store.pruned")] == ["20261202-010000-101-0001",
                                                            "20261202-010000-104-0004"]


def test_a_task_another_oomguard_still_holds_is_continued_as_soon_as_it_is_gone(
        tmp_path: Path) -> None:
    """The last run's standby, told to end, not gone yet when the daemon started (its
    RELIEVE_WAIT passed): the daemon asks again every settle, not at its next rescan (60 s),
    and continues what the standby stopped the moment it is gone."""
    import signal
    import subprocess

    from tests.helpers import wait_until
    from tests.unit._support import task_state

    keep, store, log, _clock = upkeep(tmp_path)
    job = subprocess.Popen(["sleep", "60"])
    standby = subprocess.Popen(["sleep", "60"])
    try:
        FrozenLedger(store.root / FROZEN_LEDGER, owner=standby.pid).record([job.pid])
        os.kill(job.pid, signal.SIGSTOP)
        # A task just started reads R until the stop takes (on a busy machine, a while).
        assert wait_until(lambda: task_state(job.pid) == "T", 5.0)
        keep.thaw_leftovers()
        assert keep.tick() is True  # held elsewhere: asked again soon
        assert task_state(job.pid) == "T"
        standby.kill()
        standby.wait()
        assert keep.tick() is False
        assert log.named("victim.thawed_after_crash")[0]["thawed"] == [str(job.pid)]
        assert task_state(job.pid) != "T"
    finally:
        for one in (job, standby):
            one.kill()
            one.wait()
