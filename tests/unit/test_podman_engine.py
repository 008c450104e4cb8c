"""Podman's containers: found by their cgroup, checkpointed by podman (never by CRIU behind its
back), the archive whole or absent, refused or failed down the chain; the [podman] table.
The real round trip (podman, runc, CRIU) is tests/integration/test_podman_engine.py."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.podman import PARTIAL, EngineError, PodmanEngine
from oomguard.config.actions import CHECKPOINT, KILL, Step
from oomguard.config.loading import parse_config
from oomguard.config.schema import PodmanConfig
from oomguard.control.realparts import build_podman
from oomguard.model.errors import ConfigError
from oomguard.sense.owners import PodmanContainer, owner_fields, owner_of, podman_container
from tests.unit.test_chain import ROOT, FakeProc, Rig, make_rig, make_tree, run

CID = "c0ffee" + "ab" * 29


# -- which cgroups are podman's ------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    f"/libpod_parent/libpod-{CID}",  # the cgroupfs manager
    f"/machine.slice/libpod-{CID}.scope",  # the systemd manager
    f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope/container",
    f"/oomguard-test/factory/libpod-{CID}",  # --cgroup-parent
])
def test_a_podman_containers_cgroup_names_its_id(path: str) -> None:
    assert podman_container(path) == PodmanContainer(CID)
    assert owner_of(path) == PodmanContainer(CID)
    assert owner_fields(path) == {"container_engine": "podman", "container_id": CID}


@pytest.mark.parametrize("path", [
    f"/machine.slice/libpod-conmon-{CID}.scope",  # podman's monitor, not the container
    f"/libpod_parent/libpod-{CID[:12]}",  # not a full id
    "/user.slice/libpod-notes",
    f"/kubepods/burstable/pod6b1a4c2e-9f3d-4e8a-b7c6-0d1e2f3a4b5c/libpod-{CID}",  # the kubelet's
])
def test_other_cgroups_are_not_podmans(path: str) -> None:
    assert podman_container(path) is None


# -- the engine: podman's argv, the archive whole or absent ------------------------------------

class FakePodman:
    """subprocess.run's stand-in: records the argv, writes the export, exits `status`."""

    def __init__(self, status: int = 0, stderr: str = "", raises: Exception | None = None,
                 stdout: str = "") -> None:
        self.status, self.stderr, self.raises, self.stdout = status, stderr, raises, stdout
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        assert kwargs["stdin"] == subprocess.DEVNULL and kwargs["timeout"] > 0
        if self.raises is not None:
            raise self.raises
        if "--export" in argv:
            target = Path(argv[argv.index("--export") + 1])
            assert target.name.endswith(PARTIAL), "written beside its final name"
            target.write_bytes(b"partial archive" if self.status else b"archive")
        return subprocess.CompletedProcess(argv, self.status, self.stdout, self.stderr)


def test_a_checkpoint_is_exported_zstd_and_renamed_whole_root_only(tmp_path: Path) -> None:
    podman = FakePodman()
    archive = tmp_path / "store" / "containers" / "c0ffeeabab-x.tar.zst"
    PodmanEngine(("podman", "--root", "/run/p"), run=podman).checkpoint(CID, archive)
    partial = archive.with_name(archive.name + PARTIAL)
    assert podman.calls == [["podman", "--root", "/run/p", "container", "checkpoint",
                             "--export", str(partial), "--compress", "zstd", CID]]
    assert archive.read_bytes() == b"archive" and not partial.exists()
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    assert stat.S_IMODE(archive.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("podman, said", [
    (FakePodman(125, "Error: container is not running"), "exited with status 125: Error: "
     "container is not running"),
    (FakePodman(raises=FileNotFoundError(2, "No such file", "podman")), "is not installed"),
    (FakePodman(raises=subprocess.TimeoutExpired(["podman"], 600)), "did not end within 600 s"),
])
def test_a_failed_checkpoint_says_why_and_leaves_no_archive(tmp_path: Path, podman: FakePodman,
                                                           said: str) -> None:
    archive = tmp_path / "containers" / "a.tar.zst"
    with pytest.raises(EngineError, match=said):
        PodmanEngine(run=podman).checkpoint(CID, archive)
    assert list(archive.parent.iterdir()) == []


def test_a_restore_imports_the_archive_under_a_new_name(tmp_path: Path) -> None:
    podman = FakePodman(stdout=f"{CID}\n")
    got = PodmanEngine(run=podman).restore(tmp_path / "a.tar.zst", name="job-on-b")
    assert got == CID
    assert podman.calls == [["podman", "container", "restore", "--import",
                             str(tmp_path / "a.tar.zst"), "--name", "job-on-b"]]


# -- the [podman] table ----------------------------------------------------------------------------

def test_the_podman_table_is_read_and_checked() -> None:
    config = parse_config({"podman": {"engine": "on", "command": ["podman", "--root", "/x"]}},
                          "/etc/oomguard/oomguard.toml")
    assert config.podman == PodmanConfig("on", ("podman", "--root", "/x"))
    assert parse_config({}, "f.toml").podman == PodmanConfig()
    with pytest.raises(ConfigError) as bad:
        parse_config({"podman": {"engine": "of", "command": "podman"}}, "/etc/o.toml")
    text = str(bad.value)
    assert "podman.engine" in text and "podman.command" in text and "/etc/o.toml" in text
    with pytest.raises(ConfigError, match=r"podman\.engne"):
        parse_config({"podman": {"engne": "on"}}, "f.toml")


def test_podman_is_used_where_asked_or_found() -> None:
    assert build_podman(PodmanConfig("off")) is None
    assert build_podman(PodmanConfig("auto", ("no-such-podman-here",))) is None
    engine = build_podman(PodmanConfig("on", ("no-such-podman-here",)))
    assert engine is not None and engine.command == ("no-such-podman-here",)


# -- the chain's checkpoint step on a podman container ------------------------------------------

class FakeEngine:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[tuple[str, Path]] = []

    def checkpoint(self, container_id: str, archive: Path) -> None:
        self.calls.append((container_id, archive))
        if self.error is not None:
            raise self.error


def podman_rig(tmp_path: Path, engine: FakeEngine | None) -> Rig:
    rig = make_rig(tmp_path, proc=FakeProc({ROOT: "S"}, cgroup=f"/libpod_parent/libpod-{CID}"))
    rig.runner.podman = engine  # type: ignore[assignment]
    return rig


def test_a_podman_container_is_checkpointed_by_podman_not_criu(tmp_path: Path) -> None:
    engine = FakeEngine()
    rig = podman_rig(tmp_path, engine)
    thawed: list[str] = []
    outcome = run(rig, (Step(CHECKPOINT), Step(KILL)), make_tree(),
                  after_signal=lambda: thawed.append("cgroup"))
    assert outcome.result == "checkpointed" and outcome.step == "checkpoint"
    [(cid, archive)] = engine.calls
    assert cid == CID and archive.parent == tmp_path / "store" / "containers"
    assert archive.name.startswith(CID[:12]) and archive.name.endswith(".tar.zst")
    assert thawed == ["cgroup"], "the cgroup's freeze let go before podman freezes it"
    assert rig.checkpointer.calls == []  # CRIU never ran
    [said] = [f for _, e, f in rig.log.records if e == "podman.checkpointed"]
    assert said["container_id"] == CID and said["archive"] == str(archive)
    assert said["restore"] == f"podman container restore --import {archive}"
    assert "victim.killed" not in [e for _, e, _ in rig.log.records]


def test_a_podman_container_without_podman_is_refused_untouched(tmp_path: Path) -> None:
    rig = podman_rig(tmp_path, None)
    outcome = run(rig, (Step(CHECKPOINT),), make_tree())
    assert outcome.result == "thawed" and outcome.detail == "no action settled it"
    [refused] = [f for _, e, f in rig.log.records if e == "checkpoint.refused"]
    assert "not dumped behind its engine's back" in refused["reason"]
    assert rig.checkpointer.calls == [] and not rig.freezer.frozen


def test_a_failed_podman_checkpoint_goes_on_to_the_next_step_once(tmp_path: Path) -> None:
    engine = FakeEngine(EngineError("podman container checkpoint exited with status 125"))
    rig = podman_rig(tmp_path, engine)
    outcome = run(rig, (Step(CHECKPOINT), Step(KILL)), make_tree())
    assert outcome.result == "killed" and outcome.step == "kill"
    assert len(engine.calls) == 1
    [failed] = [f for _, e, f in rig.log.records if e == "checkpoint.failed"]
    assert "status 125" in failed["error"] and failed["then"] == "kill"


def test_a_podman_container_without_room_in_the_store_is_refused(tmp_path: Path) -> None:
    engine = FakeEngine()
    rig = make_rig(tmp_path, free=1 << 20,
                   proc=FakeProc({ROOT: "S"}, cgroup=f"/libpod_parent/libpod-{CID}"))
    rig.runner.podman = engine  # type: ignore[assignment]
    outcome = run(rig, (Step(CHECKPOINT),), make_tree())
    assert outcome.result == "thawed" and engine.calls == []
    [refused] = [f for _, e, f in rig.log.records if e == "checkpoint.refused"]
    assert "MiB free" in refused["reason"]
