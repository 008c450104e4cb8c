"""Who owns a cgroup on a cluster node: a Slurm job step or a Kubernetes pod's container,
read from the cgroup's path (both schedulers, both cgroup versions, both kubelet drivers).

Slurm, cgroup v2 (cgroup/v2 plugin; the scope may carry the node name when several slurmd
run on one host):   /system.slice/[NODE_]slurmstepd.scope/job_J/step_S/user/task_T
Slurm, cgroup v1:   /slurm[_NODE]/uid_U/job_J/step_S/task_T          (inside the memory hierarchy)
Kubernetes, cgroupfs driver:   /kubepods[/burstable|/besteffort]/podUID/CONTAINER
Kubernetes, systemd driver:    /kubepods.slice[/kubepods-QOS.slice]/kubepods[-QOS]-podUID.slice/
                               (cri-containerd|crio|docker)-CONTAINER.scope
Podman, cgroupfs manager:      /libpod_parent/libpod-CONTAINER     (--cgroup-parent: its own)
Podman, systemd manager:       /machine.slice/libpod-CONTAINER.scope  (conmon: libpod-conmon-*)
Steps are numbers or batch / extern / interactive; pod UIDs use '_' for '-' under systemd.
Pure functions of the path: no filesystem access."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SLURM_V2 = re.compile(
    r"/(?:[^/]+_)?slurmstepd\.scope/job_(?P<job>\d+)"
    r"(?:/step_(?P<step>\d+|batch|extern|interactive))?"
    r"(?:/user)?(?:/task_(?P<task>\d+))?(?:/|$)")
_SLURM_V1 = re.compile(
    r"(?:^|/)slurm(?:_[^/]+)?/uid_(?P<uid>\d+)/job_(?P<job>\d+)"
    r"(?:/step_(?P<step>\d+|batch|extern|interactive))?(?:/task_(?P<task>\d+))?(?:/|$)")
_QOS = ("burstable", "besteffort")
_K8S_CGROUPFS = re.compile(
    r"(?:^|/)kubepods(?:/(?P<qos>burstable|besteffort))?/pod(?P<uid>[0-9a-fA-F-]{36})"
    r"(?:/(?P<cid>[0-9a-f]{64}))?(?:/|$)")
_K8S_SYSTEMD = re.compile(
    r"(?:^|/)kubepods\.slice(?:/kubepods-(?P<qos>burstable|besteffort)\.slice)?"
    r"/kubepods(?:-(?:burstable|besteffort))?-pod(?P<uid>[0-9a-fA-F_]{36})\.slice"
    r"(?:/(?P<runtime>cri-containerd|crio|docker)-(?P<cid>[0-9a-f]{64})\.scope)?(?:/|$)")
_PODMAN = re.compile(r"(?:^|/)libpod-(?P<cid>[0-9a-f]{64})(?:\.scope)?(?:/|$)")


@dataclass(frozen=True)
class SlurmStep:
    job_id: int
    step: str | None  # "0", "1", ..., "batch", "extern", "interactive"; None: the job itself
    uid: int | None  # v1 paths carry it; v2 paths do not
    task: int | None = None

    @property
    def label(self) -> str:
        return f"slurm job {self.job_id}" + (f" step {self.step}" if self.step else "")


@dataclass(frozen=True)
class KubeContainer:
    pod_uid: str  # with '-', as the API shows it
    qos: str  # guaranteed | burstable | besteffort
    container_id: str | None  # the runtime's id; None: the pod's own cgroup
    runtime: str | None = None  # cri-containerd | crio | docker (systemd driver paths only)

    @property
    def label(self) -> str:
        return f"pod {self.pod_uid}" + (f" container {self.container_id[:12]}"
                                        if self.container_id else "")


@dataclass(frozen=True)
class PodmanContainer:
    container_id: str  # podman's full id (64 hex)

    @property
    def label(self) -> str:
        return f"podman container {self.container_id[:12]}"


def slurm_step(path: str) -> SlurmStep | None:
    match = _SLURM_V2.search(path)
    if match:
        return SlurmStep(int(match["job"]), match["step"], None,
                         int(match["task"]) if match["task"] else None)
    match = _SLURM_V1.search(path)
    if match:
        return SlurmStep(int(match["job"]), match["step"], int(match["uid"]),
                         int(match["task"]) if match["task"] else None)
    return None


def kube_container(path: str) -> KubeContainer | None:
    match = _K8S_SYSTEMD.search(path)
    if match:
        return KubeContainer(match["uid"].replace("_", "-"), match["qos"] or "guaranteed",
                             match["cid"], match["runtime"])
    match = _K8S_CGROUPFS.search(path)
    if match:
        return KubeContainer(match["uid"], match["qos"] or "guaranteed", match["cid"])
    return None


def podman_container(path: str) -> PodmanContainer | None:
    """A container podman runs (not a Kubernetes pod's: the kubelet's runtime owns those)."""
    if kube_container(path) is not None:
        return None
    match = _PODMAN.search(path)
    return PodmanContainer(match["cid"]) if match else None


def owner_of(path: str) -> SlurmStep | KubeContainer | PodmanContainer | None:
    """The scheduler or engine object a memory cgroup belongs to, if any."""
    return slurm_step(path) or kube_container(path) or podman_container(path)


def owner_fields(path: str) -> dict[str, str | int]:
    """For a checkpoint's meta.json and the events: what the scheduler calls it."""
    owner = owner_of(path)
    if isinstance(owner, SlurmStep):
        found: dict[str, str | int] = {"scheduler": "slurm", "slurm_job_id": owner.job_id}
        if owner.step is not None:
            found["slurm_step"] = owner.step
        if owner.uid is not None:
            found["slurm_uid"] = owner.uid
        return found
    if isinstance(owner, KubeContainer):
        found = {"scheduler": "kubernetes", "pod_uid": owner.pod_uid, "qos": owner.qos}
        if owner.container_id:
            found["container_id"] = owner.container_id
        if owner.runtime:
            found["container_runtime"] = owner.runtime
        return found
    if isinstance(owner, PodmanContainer):
        return {"container_engine": "podman", "container_id": owner.container_id}
    return {}
