"""Production wiring: the real CRIU in its own memory cgroup, the store, the freezer."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from oomguard.act.criu import Criu, CriuOptions, find_criu
from oomguard.act.freezer import SigstopFreezer
from oomguard.act.hostns import host_mount_prefix
from oomguard.act.kubelet import ContainerCheckpointer, KubeletClient
from oomguard.act.podman import PodmanEngine
from oomguard.act.systemdscope import SystemdScopes
from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.config.loading import CriuConfig, DaemonConfig, GpuConfig, KubernetesConfig
from oomguard.config.schema import PodmanConfig
from oomguard.control.service import Service
from oomguard.gpu.runtime import GpuSupport, detect_gpu
from oomguard.lifecycle.checkpoint import Checkpointer
from oomguard.lifecycle.restore import Restorer, ScopeFor
from oomguard.model.errors import CgroupGone, ProcessGone
from oomguard.sense.procevents import Subscriber
from oomguard.sense.procfs import ProcReader
from oomguard.store.budget import StoreBudget
from oomguard.store.checkpoints import Store
from oomguard.store.nodestate import node_state

CRIU_CGROUP_NAME = "oomguard-criu"


def own_memory_cgroup(layout: CgroupLayout, proc: ProcReader) -> MemoryCgroup | None:
    try:
        rel = proc.memory_cgroup(os.getpid())
    except ProcessGone:
        return None
    if rel is None or layout.memory_mount is None:
        return None
    return open_cgroup(rel, layout)


def criu_cgroup(layout: CgroupLayout, proc: ProcReader, limit: int) -> MemoryCgroup | None:
    """A memory cgroup for CRIU beneath our own: the images' page cache is charged there, not to
    the guarded cgroup (and not to ours). None where it cannot be made (then CRIU runs in ours)."""
    parent = own_memory_cgroup(layout, proc)
    if parent is None:
        return None
    remove_stale_criu_cgroups(parent, proc)
    child = parent.child(f"{CRIU_CGROUP_NAME}-{os.getpid()}")
    try:
        child.create()
        child.set_limit(limit)
    except (OSError, CgroupGone):
        return None
    return child


def remove_stale_criu_cgroups(parent: MemoryCgroup, proc: ProcReader) -> None:
    """CRIU cgroups of oomguard processes that died without cleaning up (empty ones only)."""
    prefix = f"{CRIU_CGROUP_NAME}-"
    try:
        entries = list(parent.path.iterdir())
    except OSError:
        return
    for entry in entries:
        owner = entry.name[len(prefix):]
        if entry.name.startswith(prefix) and owner.isdigit() and not proc.exists(int(owner)):
            with contextlib.suppress(OSError):
                entry.rmdir()  # fails while a CRIU of the dead owner still runs in it


@functools.lru_cache(maxsize=4)
def build_gpu(settings: GpuConfig) -> GpuSupport:
    """What this machine offers GPU processes (probed once per process and settings)."""
    return detect_gpu(settings.engine, settings.cuda_checkpoint,
                      lock_timeout=settings.lock_timeout, timeout=settings.timeout)


def no_plugins_dir() -> str:
    """An empty directory for CRIU's --libdir: oomguard drives cuda-checkpoint itself, so
    CRIU's CUDA plugin must not do it a second time."""
    path = os.path.join(tempfile.gettempdir(), "oomguard-criu-no-plugins")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def build_criu(criu_config: CriuConfig, layout: CgroupLayout, proc: ProcReader,
               gpu: GpuSupport | None = None, store: Path | None = None) -> Criu:
    """CRIU as configured; `store`: the store it writes into, which must be the same
    directory in the namespace CRIU is run in (oomguard.act.hostns)."""
    binary, version = find_criu(criu_config.binary)
    libdir = no_plugins_dir() if gpu is not None and gpu.drives_cuda and gpu.plugin else None
    options = replace(CriuOptions(), ghost_limit=criu_config.ghost_limit,
                      timeout=criu_config.timeout, tcp_close=criu_config.tcp_close,
                      libdir=libdir)
    confine = criu_cgroup(layout, proc, criu_config.cgroup_limit)
    return Criu(binary=binary, version=version, options=options,
                cgroup_procs=confine.path / "cgroup.procs" if confine is not None else None,
                host_ns=host_mount_prefix(binary, criu_config.mount_namespace, store=store))


def open_store(config: DaemonConfig, algorithm: str | None = None) -> Store:
    """The store, with this node's state directory (oomguard.store.nodestate): the daemon's
    config has it resolved already; a verb run without the daemon resolves it here."""
    state = config.state_dir if config.state_dir is not None else node_state(config.store).path
    return Store(config.store, algorithm=algorithm, state=state)


def build_checkpointer(config: DaemonConfig, criu: Criu, proc: ProcReader | None = None,
                       events: Subscriber | None = None) -> Checkpointer:
    """`events`: the process-event subscriptions the freeze uses (one is made if not given;
    the daemon passes its own, probed at start)."""
    proc = proc or ProcReader()
    store = open_store(config, algorithm=config.criu.checksum)
    checkpointer = Checkpointer(criu, store, SigstopFreezer(proc, events=events), proc,
                                gpu=build_gpu(config.gpu),
                                gpu_margin=config.gpu.host_margin,
                                compress_level=config.criu.compress_level
                                if config.criu.compress == "zstd" else None)
    checkpointer.budget = StoreBudget(store, config.store_max_size, config.store_keep_free,
                                      config.store_max_age)
    return checkpointer


def build_restorer(config: DaemonConfig, criu: Criu, proc: ProcReader | None = None,
                   events: Subscriber | None = None,
                   layout: CgroupLayout | None = None) -> Restorer:
    """On a systemd host with the unified hierarchy, a unit's job is restored into a new
    scope (oomguard/act/systemdscope.py)."""
    proc = proc or ProcReader()
    return Restorer(criu, open_store(config), SigstopFreezer(proc, events=events), proc,
                    gpu=build_gpu(config.gpu), scopes=systemd_scopes(layout))


def systemd_scopes(layout: CgroupLayout | None) -> ScopeFor | None:
    if layout is None or layout.unified is None or not layout.unified_has_memory:
        return None
    scopes = SystemdScopes(lambda path: open_cgroup(path, layout), cgroup_root=layout.unified)
    return scopes.holding if scopes.available() else None


def remove_criu_cgroup(layout: CgroupLayout, proc: ProcReader) -> None:
    parent = own_memory_cgroup(layout, proc)
    if parent is not None:
        with contextlib.suppress(OSError):
            parent.child(f"{CRIU_CGROUP_NAME}-{os.getpid()}").remove()


def build_service(config: DaemonConfig, layout: CgroupLayout, proc: ProcReader,
                  with_criu: bool = True, checkpointer: Checkpointer | None = None,
                  restorer: Restorer | None = None,
                  status: Callable[[], dict[str, Any]] | None = None,
                  user_headroom: Callable[[MemoryCgroup], int] | None = None) -> Service:
    """The verbs of the control socket. CRIU is located only when a checkpointer or restorer
    has to be built for it (not for list/show/forget, nor when the daemon passes its own)."""
    if checkpointer is None or restorer is None:
        criu = (build_criu(config.criu, layout, proc, build_gpu(config.gpu), config.store)
                if with_criu else Criu(binary="criu", version=()))
        checkpointer = checkpointer or build_checkpointer(config, criu, proc)
        restorer = restorer or build_restorer(config, criu, proc, layout=layout)
    service = Service(open_store(config), restorer, checkpointer, layout, proc, status)
    service.budget = checkpointer.budget
    if user_headroom is not None:
        service.user_headroom = user_headroom
    return service


def build_podman(settings: PodmanConfig) -> PodmanEngine | None:
    """Podman's checkpoint for its containers' victims: "auto" where its command is
    installed, never when "off" ("on": refused with podman's words if it cannot run)."""
    if settings.engine == "off" or (settings.engine == "auto"
                                     and shutil.which(settings.command[0]) is None):
        return None
    return PodmanEngine(settings.command)


def build_containers(settings: KubernetesConfig) -> ContainerCheckpointer | None:
    """The kubelet checkpoint API for kubepods victims: "auto" where a service-account token
    is mounted (oomguard runs as the DaemonSet), never when "off"."""
    token = Path(settings.token_file)
    if settings.kubelet == "off" or (settings.kubelet == "auto" and not token.exists()):
        return None
    return ContainerCheckpointer(KubeletClient(
        settings.kubelet_url, token_file=token,
        ca_file=Path(settings.ca_file) if settings.ca_file else None))
