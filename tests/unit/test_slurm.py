"""Telling Slurm about a checkpoint: the scontrol calls, against a fake scontrol executable
(the real one runs in the Slurm end-to-end test)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from oomguard.lifecycle.checkpointrun import CheckpointTimings
from oomguard.observe.events import CheckpointDone
from oomguard.observe.slurm import SlurmError, SlurmNotifier, admin_comment, find_scontrol
from tests.unit.test_store import make_meta

FAKE = """#!{python}
import json, os, sys
with open({log!r}, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_SCONTROL_FAIL") in sys.argv[1:2]:
    print("slurm_update error: Invalid job id specified", file=sys.stderr)
    sys.exit(1)
"""


@pytest.fixture
def scontrol(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls"
    path = tmp_path / "scontrol"
    path.write_text(FAKE.format(python=sys.executable, log=str(log)))
    path.chmod(0o755)
    return path, log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def comment_of(call: list[str]) -> str:
    assert call[:2] == ["update", "JobId=4711"] and call[2].startswith("AdminComment=")
    return call[2]


@pytest.mark.parametrize(("after", "tail"), [
    ("none", []), ("requeue", [["update", "JobId=4711", "StartTime=now"], ["release", "4711"]]),
    ("requeuehold", [])])
def test_notify_requeues_held_then_comments(scontrol: tuple[Path, Path], after: str,
                                            tail: list[list[str]]) -> None:
    path, log = scontrol
    done = SlurmNotifier(str(path), after).notify(4711, "0", "20261130-1-ab", 1_764_500_000.0,
                                                  'resident "memory" 90%\nof limit')
    found = calls(log)
    if after == "none":  # a finished job takes no comment: tried, and Slurm's answer reported
        assert len(found) == 1 and done == ["admin_comment"]
        comment = comment_of(found[0])
    else:
        assert found[0] == ["requeuehold", "4711"]
        comment = comment_of(found[1])
        assert found[2:] == tail
        assert done == ["requeuehold", "admin_comment"] + (["released"] if tail else [])
    assert comment.startswith("AdminComment=oomguard: step 0 checkpointed instead of OOM-killed "
                              "at 2025-11-30T")
    assert "checkpoint 20261130-1-ab" in comment and '"' not in comment and "\n" not in comment


def test_scontrol_failure_is_an_error_with_its_message(scontrol: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path, _log = scontrol
    monkeypatch.setenv("FAKE_SCONTROL_FAIL", "update")
    with pytest.raises(SlurmError, match="exit status 1: slurm_update error: Invalid job id"):
        SlurmNotifier(str(path), "requeue").notify(1, None, "x", 0.0, "r")


def test_comment_is_one_bounded_line() -> None:
    text = admin_comment("id", None, 0.0, "x" * 5000)
    assert text.startswith("oomguard: job checkpointed") and len(text) == 1000


def test_find_scontrol(tmp_path: Path, scontrol: tuple[Path, Path]) -> None:
    assert find_scontrol(str(scontrol[0])) == str(scontrol[0])
    assert find_scontrol(str(tmp_path / "missing")) is None


def test_requeue_with_more_memory(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    path = tmp_path / "scontrol"
    path.write_text(FAKE.format(python=sys.executable, log=str(log)).replace(
        'sys.exit(1)', 'sys.exit(1)\nif sys.argv[1:2] == ["show"]:\n    print("JobId=7 '
        'MinMemoryNode=256M MinTmpDiskNode=0")'))
    path.chmod(0o755)
    done = SlurmNotifier(str(path), "requeue", grow_memory=2.0).notify(7, None, "c", 0.0, "r")
    assert [c[:2] for c in calls(log)] == [["show", "job"], ["requeuehold", "7"],
                                           ["update", "JobId=7"], ["update", "JobId=7"],
                                           ["update", "JobId=7"], ["release", "7"]]
    assert calls(log)[3][2] == "MinMemoryNode=512"
    assert done == ["requeuehold", "admin_comment", "memory 256M -> 512M", "released"]


@pytest.mark.parametrize(("text", "mib"), [
    ("JobId=7 ... MinMemoryNode=256M MinTmpDiskNode=0", 256),
    ("MinMemoryNode=2G", 2048), ("MinMemoryCPU=512000K", 500), ("MinMemoryNode=100", 100),
    ("no memory here", None)])
def test_job_memory(text: str, mib: int | None) -> None:
    from oomguard.observe.slurm import job_memory_mib
    assert job_memory_mib(text) == mib


# -- whose job a checkpoint was: the checkpoint's owner fields, not the guard's name -----------

class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None, str]] = []
        self.done = threading.Event()

    def notify(self, job_id: int, step: str | None, checkpoint_id: str, when: float,
               reason: str) -> str:
        self.calls.append((job_id, step, checkpoint_id))
        self.done.set()
        return "requeue"


SLURM_OWNER = {"scheduler": "slurm", "slurm_job_id": 42, "slurm_step": "0", "slurm_uid": 1000}
TIMINGS = CheckpointTimings(freeze_s=0.01, dump_s=1.2, commit_s=0.05, total_s=1.3)


@pytest.mark.parametrize("guard_name", [
    "system",  # a system rule's checkpoint
    "/sys/fs/cgroup/memory/slurm/uid_1000/job_42 (GPU)",  # a GPU rule's
    "/sys/fs/cgroup/memory/slurm/uid_1000/job_42",  # a cgroup rule's
])
def test_the_job_comes_from_the_checkpoints_owner_fields(guard_name: str) -> None:
    from oomguard.daemon.telemetry import EventTap
    recorder = _Recorder()
    tap = EventTap(slurm=recorder)  # type: ignore[arg-type]
    tap.tell(CheckpointDone(make_meta("20261201-1-ab", extra=dict(SLURM_OWNER)), TIMINGS,
                            {"cgroup": guard_name}))
    assert recorder.done.wait(5)
    assert recorder.calls == [(42, "0", "20261201-1-ab")]


def test_no_owner_fields_no_slurm_call() -> None:
    from oomguard.daemon.telemetry import EventTap
    from oomguard.observe.events import slurm_owner
    recorder = _Recorder()
    tap = EventTap(slurm=recorder)  # type: ignore[arg-type]
    tap.tell(CheckpointDone(make_meta("x"), TIMINGS,
                            {"cgroup": "/sys/fs/cgroup/memory/slurm/uid_1/job_7"}))
    # A checkpoint asked for over the socket is no OOM saved: Slurm is not told.
    tap.tell(CheckpointDone(make_meta("y", extra=dict(SLURM_OWNER)), TIMINGS,
                            requested_by=1000))
    assert not recorder.done.wait(0.2) and recorder.calls == []
    assert slurm_owner({"scheduler": "kubernetes", "pod_uid": "p"}) is None
    assert slurm_owner({"scheduler": "slurm", "slurm_job_id": "nope"}) is None
