"""The validated configuration: what oomguard.config.loading makes of a TOML file or flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from oomguard.config.actions import Step
from oomguard.detect.memavailable import MIN_AVAILABLE
from oomguard.detect.registry import defaults as signal_defaults
from oomguard.model.checksums import ALGORITHMS, XXH3
from oomguard.model.errors import ConfigIssue

ON_FAILURE_THAW = "thaw"  # a failed checkpoint: the tree is thawed and runs on
ON_FAILURE_KILL = "kill"  # ...or killed (the chain checkpoint, kill)


@dataclass(frozen=True)
class CriuConfig:
    binary: str = "auto"
    ghost_limit: int = 64 << 20
    timeout: float = 300.0
    tcp_close: bool = True
    cgroup_limit: int = 256 << 20  # CRIU's own memory cgroup bounds the images' page cache
    checksum: str = XXH3  # of new checkpoints' images: xxh3 (XXH128SUMS) | sha256 (SHA256SUMS)
    compress: str = "off"  # pages stored as: off (as CRIU wrote them) | zstd (pages-N.img.zst)
    compress_level: int = 3  # zstd's level, 1-19
    # CRIU's mount namespace when the daemon has one of its own: auto (PID 1's, when CRIU is
    # the same file there) | off (the daemon's) | a path such as /proc/PID/ns/mnt
    mount_namespace: str = "auto"


CHECKSUMS = ALGORITHMS  # the names criu.checksum takes
COMPRESSIONS = ("off", "zstd")
GPU_ENGINES = ("auto", "cuda-checkpoint", "criu-plugin", "off")
GPU_PREFERENCES = ("neutral", "prefer", "avoid")


@dataclass(frozen=True)
class GpuConfig:
    """[gpu]: how CUDA processes are checkpointed (docs in config/oomguard.toml)."""

    engine: str = "auto"  # auto | cuda-checkpoint | criu-plugin | off
    cuda_checkpoint: str = "auto"  # path, or auto: $OOMGUARD_CUDA_CHECKPOINT, /usr/{local/,}bin, PATH
    lock_timeout: float = 10.0  # cuda-checkpoint --action lock --timeout
    timeout: float = 300.0  # any one cuda-checkpoint step
    poll_interval: float = 2.0  # NVML is read this often, only while a rule has gpu_threshold
    host_margin: int = 256 << 20  # host memory kept free beyond the VRAM copied into the process


@dataclass(frozen=True)
class SlurmConfig:
    """[slurm]: what Slurm is told when one of its job steps is checkpointed."""

    notify: str = "auto"  # auto (when scontrol is installed) | on | off
    scontrol: str = "auto"
    after_checkpoint: str = "none"  # none | requeue | requeuehold
    grow_memory: float = 1.0  # the requeued job asks for this many times its memory


@dataclass(frozen=True)
class KubernetesConfig:
    """[kubernetes]: containers are checkpointed by their kubelet, never dumped directly."""

    kubelet: str = "auto"  # auto (when a service-account token is mounted) | on | off
    kubelet_url: str = "https://127.0.0.1:10250"
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str = ""  # the kubelet's serving CA; "": its certificate is not verified


@dataclass(frozen=True)
class PodmanConfig:
    """[podman]: podman's containers are checkpointed by podman (an archive it restores),
    never dumped behind its back."""

    engine: str = "auto"  # auto (when the command is installed) | on | off
    command: tuple[str, ...] = ("podman",)  # argv before `container checkpoint ...`


@dataclass(frozen=True)
class GuardConfig:
    cgroups: tuple[str, ...]
    threshold: float = 0.85
    headroom: int = 64 << 20
    user_headroom: bool = False  # on-demand checkpoints by non-root users get headroom too
    on_failure: str = ON_FAILURE_THAW
    events: bool = True  # kernel notifications; False: poll only
    memory_high: bool = True  # v2: memory.high at the threshold (throttles, raises `high` events)
    freeze_cgroup: bool = True  # v2: cgroup.freeze the whole cgroup first (growth stops at once)
    psi: bool = True  # v2 / system: a PSI trigger on the pressure file wakes the daemon
    oom_kill_disable: bool = True  # v1: tasks at the limit wait for oomguard, never OOM-killed
    park_deadline: float = 30.0  # v1: ...but for this long at most (the park watchdog)
    system: bool = False  # a system-wide rule (MemAvailable), for hosts without cgroup limits
    victim_cgroups: tuple[str, ...] = ()  # system rules: only processes in these subtrees
    auto_restore: bool = False  # restore this cgroup's checkpoints once memory is free again
    restore_quiet: float = 10.0  # ...for this long without interruption
    restore_margin: int = 64 << 20  # room left under the threshold after a restore
    restore_attempts: int = 3  # failed auto-restores of a checkpoint before it is `stuck`
    restore_retry: float = 60.0  # a failed auto-restore is retried after this long
    actions: tuple[Step, ...] = ()  # the action chain; () = checkpoint (+ kill if on_failure)
    prefer: tuple[str, ...] = ()  # regexes on name/command line: chosen first
    avoid: tuple[str, ...] = ()  # ...chosen last
    protect: tuple[str, ...] = ()  # ...never chosen
    protect_session_leaders: bool = False  # never a login shell or desktop session's leader
    # Take session processes (an interactive shell, a terminal multiplexer, an ssh session, a
    # desktop session's leader) into victim trees as any other process; False: never a victim,
    # the jobs below them are (oomguard.policy.sessions).
    take_sessions: bool = False
    post_action_delay: float = 0.0  # after acting on a cgroup, wait before acting there again
    freeze_deadline: float = 60.0  # a freeze ends (dump, thaw or kill) within this
    kill_grace: float = 5.0  # SIGTERM, then SIGKILL after this
    store_margin: int = 256 << 20  # free space wanted in the store beyond the image estimate
    gpu: str = "neutral"  # GPU processes in victim choice: neutral | prefer | avoid
    # The detection plug-ins' keys (oomguard.detect: a system rule's min_available, a share of
    # MemTotal or bytes, and psi_full_avg10; a cgroup rule's time_to_limit and predict_from;
    # any rule's gpu_threshold, a share of a GPU's memory...)
    # as (key, value) pairs, every plug-in's key present (a key not given takes its plug-in's
    # default), in key order.
    signals: tuple[tuple[str, Any], ...] = ()
    _settings: Mapping[str, Any] = field(init=False, repr=False, compare=False,
                                         default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        given, known = dict(self.signals), signal_defaults()
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"no detection plug-in has the key {unknown[0]!r}")
        settings = {**known, **given}
        object.__setattr__(self, "signals", tuple(sorted(settings.items())))
        # Read on every look at the rule's guards: made once (read-only), not per call.
        object.__setattr__(self, "_settings", MappingProxyType(settings))

    def signal_settings(self) -> Mapping[str, Any]:
        """Every detection plug-in's key, at this rule's value."""
        return self._settings

    @property
    def min_available(self) -> float | int:
        """The MemAvailable floor (oomguard.detect.memavailable): a share of MemTotal (float)
        or bytes (int). The system rule's polling follows it too."""
        value: float | int = self.signal_settings()[MIN_AVAILABLE]
        return value


DEFAULT_STORE = Path("/var/lib/oomguard")  # the checkpoint store, in one place


@dataclass(frozen=True)
class DaemonConfig:
    source: str
    store: Path = DEFAULT_STORE
    # This node's records (crash ledgers, lock, swap files): None, where the store is (or, for
    # a store on a file system other nodes share, /run/oomguard/state/...: store.nodestate).
    state_dir: Path | None = None
    poll_interval: float = 0.1
    rescan_interval: float = 60.0  # the safety rescan: inotify and the kernel's events tell the rest
    dry_run: bool = False
    nice: int = -10  # the threads from a crossing to SIGSTOP (priority.py); 0: untouched
    socket: Path = Path("/run/oomguard/control.sock")
    control_idle_timeout: float = 30.0  # a connection that starts no request for this long: closed
    control_call_rate: float = 20.0  # calls a second per non-root uid; beyond it they wait
    # The store's budget: its cap, and what its file system keeps free; bytes (int), a share
    # of the file system (float), or None: none (oomguard.policy.budget).
    store_max_size: int | float | None = 0.10
    store_keep_free: int | float | None = 0.15
    store_max_age: float | None = 30 * 86400.0  # restored checkpoints older than this go
    # What a clean stop does with paged-out trees (the pageout action): "keep" them stopped
    # and recorded (the next daemon continues them once they fit), or "resume" them all.
    pageout_at_stop: str = "keep"
    metrics_textfile_dir: Path | None = None  # node_exporter textfile collector directory
    metrics_port: int = 0  # serve /metrics on this local port (0: off)
    metrics_address: str = "127.0.0.1"
    oomd_prekill_dir: Path | None = None  # serve systemd-oomd's prekill hook in this directory
    dbus_notify: bool = True  # a system D-Bus signal per checkpoint/restore (notify-agent)
    dbus_address: str = "SYSTEM"
    hooks: tuple[tuple[str, str], ...] = ()  # (event, shell command): on_checkpoint...
    hook_timeout: float = 30.0
    criu: CriuConfig = field(default_factory=CriuConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    podman: PodmanConfig = field(default_factory=PodmanConfig)
    guards: tuple[GuardConfig, ...] = ()
    # What parsed but looks like a mistake (a size of 64 bytes): check-config prints these,
    # the daemon logs them. Not part of the configuration's value.
    warnings: tuple[ConfigIssue, ...] = field(default=(), compare=False, repr=False)

    @property
    def node_state_dir(self) -> Path:
        """Where this node's records live once resolved (the store where none was set)."""
        return self.store if self.state_dir is None else self.state_dir
