"""Scheduler cgroup paths: Slurm (cgroup v1 and v2) and Kubernetes (cgroupfs and systemd
drivers, cgroup v1 and v2), as they appear in /proc/PID/cgroup and in the hierarchy."""

from __future__ import annotations

import pytest

from oomguard.sense.owners import KubeContainer, SlurmStep, kube_container, owner_fields, slurm_step

CID = "3f1c9a0e4b5d6c7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f6"
UID = "6b1a4c2e-9f3d-4e8a-b7c6-0d1e2f3a4b5c"


@pytest.mark.parametrize(("path", "expected"), [
    # cgroup v2, cgroup/v2 plugin under systemd
    ("/system.slice/slurmstepd.scope/job_4711/step_0/user/task_0",
     SlurmStep(4711, "0", None, 0)),
    ("/system.slice/slurmstepd.scope/job_4711/step_batch/user/task_0",
     SlurmStep(4711, "batch", None, 0)),
    ("/system.slice/slurmstepd.scope/job_4711/step_extern/user/task_special",
     SlurmStep(4711, "extern", None, None)),
    ("/system.slice/slurmstepd.scope/job_12/step_interactive/user",
     SlurmStep(12, "interactive", None, None)),
    ("/system.slice/slurmstepd.scope/job_12", SlurmStep(12, None, None, None)),
    ("/system.slice/node07_slurmstepd.scope/job_9/step_3/user/task_2", SlurmStep(9, "3", None, 2)),
    # cgroup v1, inside the memory hierarchy
    ("/slurm/uid_1000/job_4711/step_0/task_1", SlurmStep(4711, "0", 1000, 1)),
    ("/slurm/uid_1000/job_4711/step_batch", SlurmStep(4711, "batch", 1000, None)),
    ("/slurm_node07/uid_0/job_1/step_extern/task_0", SlurmStep(1, "extern", 0, 0)),
    ("/slurm/uid_1000/job_4711", SlurmStep(4711, None, 1000, None)),
    # not Slurm
    ("/system.slice/slurmd.service", None),
    ("/user.slice/user-1000.slice/session-3.scope", None),
    ("/slurm/uid_x/job_1", None),
    ("/system.slice/slurmstepd.scope/job_/step_0", None),
    ("/jobs/job_4711/step_0", None),
])
def test_slurm_paths(path: str, expected: SlurmStep | None) -> None:
    assert slurm_step(path) == expected


@pytest.mark.parametrize(("path", "expected"), [
    # cgroupfs driver (v1 memory hierarchy or v2)
    (f"/kubepods/burstable/pod{UID}/{CID}", KubeContainer(UID, "burstable", CID)),
    (f"/kubepods/besteffort/pod{UID}/{CID}", KubeContainer(UID, "besteffort", CID)),
    (f"/kubepods/pod{UID}/{CID}", KubeContainer(UID, "guaranteed", CID)),
    (f"/kubepods/burstable/pod{UID}", KubeContainer(UID, "burstable", None)),
    # systemd driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}"
     f".slice/cri-containerd-{CID}.scope",
     KubeContainer(UID, "burstable", CID, "cri-containerd")),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}"
     f".slice/crio-{CID}.scope", KubeContainer(UID, "besteffort", CID, "crio")),
    (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope",
     KubeContainer(UID, "guaranteed", CID, "docker")),
    (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice",
     KubeContainer(UID, "guaranteed", None)),
    # not a pod
    ("/kubepods.slice/kubepods-burstable.slice", None),
    ("/kubepods", None),
    ("/system.slice/kubelet.service", None),
    (f"/kubepods/burstable/pod{UID[:-1]}/{CID}", None),
])
def test_kubernetes_paths(path: str, expected: KubeContainer | None) -> None:
    assert kube_container(path) == expected


def test_owner_fields_for_checkpoints() -> None:
    assert owner_fields("/slurm/uid_1000/job_4711/step_0/task_0") == {
        "scheduler": "slurm", "slurm_job_id": 4711, "slurm_step": "0", "slurm_uid": 1000}
    assert owner_fields("/system.slice/slurmstepd.scope/job_5/step_batch/user/task_0") == {
        "scheduler": "slurm", "slurm_job_id": 5, "slurm_step": "batch"}
    assert owner_fields(f"/kubepods/burstable/pod{UID}/{CID}") == {
        "scheduler": "kubernetes", "pod_uid": UID, "qos": "burstable", "container_id": CID}
    assert owner_fields("/user.slice") == {}


def test_labels() -> None:
    assert SlurmStep(4711, "batch", None).label == "slurm job 4711 step batch"
    assert KubeContainer(UID, "burstable", CID).label == f"pod {UID} container {CID[:12]}"
