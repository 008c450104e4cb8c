"""Every way a restore of an existing checkpoint fails is told as restore.failed (the daemon
logs it, counts it and keeps it for `status`): through the service, whatever the error, and
in the keeper's auto-restore; an unknown id or a refusal of rights is only answered."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.cgroup.mounts import CgroupLayout
from oomguard.config.loading import GuardConfig
from oomguard.control.server import dispatch
from oomguard.control.service import PermissionDenied, Service
from oomguard.daemon.autorestore import RESTORE_BACKOFF, AutoRestorer
from oomguard.daemon.guards import CgroupGuard
from oomguard.lifecycle.restoreoutcome import failure_fields
from oomguard.model.errors import CgroupGone, CriuError, RestoreFailed
from oomguard.observe.events import LogSink
from oomguard.store.checkpoints import CheckpointMeta, Store

MiB = 1 << 20
NO_CGROUPS = CgroupLayout(memory_v1=None, unified=None, unified_controllers=())
CRIU_LOG = ("(00.012345) 1234: Error (criu/files-reg.c:2192): Can't open file tmp/job.log "
            "on restore: No such file or directory\n(00.0124) Error (criu/cr-restore.c:1): "
            "Restoring FAILED.")


def meta_of(checkpoint_id: str) -> CheckpointMeta:
    return CheckpointMeta(id=checkpoint_id, pid=70, pids=[70], command="job", comm="job", uid=0,
                          user="root", cgroup="/jobs/a", cgroup_version=1, rss_bytes=100 * MiB,
                          reason="test", criu_version="4.2", created=1_700_000_000.0)


def stored(root: Path, checkpoint_id: str = "job-1") -> Store:
    store = Store(root)
    meta = meta_of(checkpoint_id)
    images, lock_fd = store.begin(meta)
    os.close(lock_fd)
    (images / "pages-1.img").write_bytes(b"\0" * 4096)
    store.commit(meta)
    return store


def criu_failure() -> RestoreFailed:
    try:
        raise CriuError("criu restore exited with status 1", CRIU_LOG)
    except CriuError as exc:
        try:
            raise RestoreFailed("criu restore of job-1 failed; the checkpoint is intact") \
                from exc
        except RestoreFailed as failed:
            return failed


class Told:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    error = __call__
    warning = __call__
    info = __call__


@pytest.fixture
def told() -> Told:
    return Told()


def service_failing(tmp_path: Path, told: Told, error: BaseException) -> Service:
    def restore(checkpoint_id: str, **_: Any) -> Any:
        raise error

    service = Service(stored(tmp_path / "store"), restorer=SimpleNamespace(restore=restore),  # type: ignore[arg-type]
                      checkpointer=SimpleNamespace(), layout=NO_CGROUPS)  # type: ignore[arg-type]
    service.events = LogSink(told)  # the lines the daemon logs
    return service


def call(service: Service, checkpoint_id: str, uid: int = 0) -> dict[str, Any]:
    raw = json.dumps({"method": "io.oomguard.Restore",
                      "parameters": {"id": checkpoint_id}}).encode()
    return dispatch(service, raw, uid, 1234)[1]


def test_criu_s_own_line_goes_with_the_error() -> None:
    fields = failure_fields(criu_failure())
    assert fields["error"] == "criu restore of job-1 failed; the checkpoint is intact"
    assert fields["criu_error"] == ("Can't open file tmp/job.log on restore: No such file or "
                                    "directory")


def test_an_error_without_criu_is_one_line_and_has_no_criu_field() -> None:
    assert failure_fields(OSError("first\nsecond")) == {"error": "first"}
    assert failure_fields(CgroupGone("")) == {"error": "CgroupGone"}


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   CgroupGone("target cgroup /jobs/a is gone"),
                                   criu_failure()])
def test_any_failure_of_the_restore_is_told_and_answered(tmp_path: Path, told: Told,
                                                          error: BaseException) -> None:
    reply = call(service_failing(tmp_path, told, error), "job-1")
    assert reply["error"] == "io.oomguard.Failed"  # answered, never a dropped connection
    assert [e for e, _ in told.events] == ["restore.failed"]
    fields = told.events[0][1]
    assert fields["id"] == "job-1" and fields["auto"] is False and fields["requested_by"] == 0
    assert fields["uid"] == 0 and fields["cgroup"] == "/jobs/a"
    assert str(error).splitlines()[0] in fields["error"] or str(error) == ""


def test_an_unreadable_entry_is_a_failed_restore_for_root(tmp_path: Path, told: Told) -> None:
    service = service_failing(tmp_path, told, AssertionError("not reached"))
    (service.store.root / "job-1" / "meta.json").write_text("{not json")
    reply = call(service, "job-1")
    assert reply["error"] == "io.oomguard.Failed"
    assert [(e, f["id"]) for e, f in told.events] == [("restore.failed", "job-1")]
    assert "meta.json" in told.events[0][1]["error"]


def test_an_unknown_or_invalid_id_or_another_s_checkpoint_is_only_answered(
        tmp_path: Path, told: Told) -> None:
    service = service_failing(tmp_path, told, AssertionError("not reached"))
    assert call(service, "job-2")["error"] == "io.oomguard.NotFound"
    assert call(service, "job-1", uid=1000)["error"] == "io.oomguard.NotFound"  # root's
    assert call(service, "../etc")["error"] == "io.oomguard.InvalidRequest"
    assert told.events == []


def test_a_refusal_of_rights_is_only_answered(tmp_path: Path, told: Told) -> None:
    service = service_failing(tmp_path, told, PermissionDenied("not into /other"))
    assert call(service, "job-1")["error"] == "io.oomguard.PermissionDenied"
    assert told.events == []


@pytest.mark.parametrize("error", [criu_failure(), CgroupGone("gone"), OSError(5, "EIO")])
def test_a_failed_auto_restore_is_told_whatever_the_error(tmp_path: Path, told: Told,
                                                          error: BaseException) -> None:
    def restore(checkpoint_id: str, **_: Any) -> Any:
        raise error

    store = stored(tmp_path / "store")
    now = [100.0]
    keeper = AutoRestorer(store, SimpleNamespace(restore=restore), told,  # type: ignore[arg-type]
                          clock=lambda: now[0])
    guard = CgroupGuard(spec=GuardConfig(cgroups=("/jobs/a",)),
                        cgroup=SimpleNamespace(path=Path("/jobs/a")),  # type: ignore[arg-type]
                        pattern="")
    keeper.restore(guard, "job-1")
    assert [e for e, _ in told.events] == ["restore.failed"]
    fields = told.events[0][1]
    assert fields["auto"] is True and fields["id"] == "job-1"
    assert fields["retry_in_s"] == RESTORE_BACKOFF
    assert ("criu_error" in fields) == isinstance(error, RestoreFailed)
