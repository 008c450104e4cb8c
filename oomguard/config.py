"""Configuration: TOML file or command-line flags -> validated, unit-converted dataclasses.

Every problem is collected (file, key, reason) and raised at once as ConfigError.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from oomguard.actions import Step, parse_chain
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.checkpoint import ON_FAILURE_KILL, ON_FAILURE_THAW
from oomguard.errors import ConfigError, ConfigIssue
from oomguard.preferences import compile_patterns
from oomguard.units import (
    HOUR,
    MAX_AGE,
    bounded_duration,
    bounded_size,
    parse_fraction,
)

DEFAULT_CONFIG_PATH = Path("/etc/oomguard/oomguard.toml")
EMBEDDED_CONFIG = "<embedded default>"
T = TypeVar("T")


@dataclass(frozen=True)
class CriuConfig:
    binary: str = "auto"
    ghost_limit: int = 64 << 20
    timeout: float = 300.0
    tcp_close: bool = True
    cgroup_limit: int = 256 << 20  # CRIU's own memory cgroup bounds the images' page cache


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
    min_available: float | int = 0.10  # system rules: fraction of MemTotal (float) or bytes (int)
    victim_cgroups: tuple[str, ...] = ()  # system rules: only processes in these subtrees
    psi_full_avg10: float | None = None  # system rules: also act at this PSI "full" avg10
    auto_restore: bool = False  # restore this cgroup's checkpoints once memory is free again
    restore_quiet: float = 10.0  # ...for this long without interruption
    restore_margin: int = 64 << 20  # room left under the threshold after a restore
    actions: tuple[Step, ...] = ()  # the action chain; () = checkpoint (+ kill if on_failure)
    prefer: tuple[str, ...] = ()  # regexes on name/command line: chosen first
    avoid: tuple[str, ...] = ()  # ...chosen last
    protect: tuple[str, ...] = ()  # ...never chosen
    protect_session_leaders: bool = False  # never a login shell or desktop session's leader
    post_action_delay: float = 0.0  # after acting on a cgroup, wait before acting there again
    time_to_limit: bool = False  # act early when growth would hit the limit before a dump ends
    predict_from: float = 0.5  # watch growth (poll) once usage passes this share of the limit
    freeze_deadline: float = 60.0  # a freeze ends (dump, thaw or kill) within this
    kill_grace: float = 5.0  # SIGTERM, then SIGKILL after this
    store_margin: int = 256 << 20  # free space wanted in the store beyond the image estimate
    gpu: str = "neutral"  # GPU processes in victim choice: neutral | prefer | avoid
    gpu_threshold: float | None = None  # also act when a GPU's memory reaches this share


@dataclass(frozen=True)
class DaemonConfig:
    source: str
    store: Path = Path("/var/lib/oomguard")
    poll_interval: float = 0.1
    rescan_interval: float = 2.0
    dry_run: bool = False
    socket: Path = Path("/run/oomguard/control.sock")
    store_max_size: int | None = None  # size budget of the store; None: no budget
    store_max_age: float | None = 30 * 86400.0  # restored checkpoints older than this go
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
    guards: tuple[GuardConfig, ...] = ()


class _Reader:
    """Pulls typed values out of a TOML table, recording an issue instead of raising."""

    def __init__(self, source: str, issues: list[ConfigIssue]) -> None:
        self.source = source
        self.issues = issues

    def take(self, table: dict[str, Any], prefix: str, key: str, convert: Callable[[Any], T],
             default: T) -> T:
        if key not in table:
            return default
        try:
            return convert(table.pop(key))
        except (ValueError, TypeError) as exc:
            self.issues.append(ConfigIssue(self.source, f"{prefix}{key}", str(exc)))
            return default

    def leftovers(self, table: dict[str, Any], prefix: str) -> None:
        for key in table:
            self.issues.append(ConfigIssue(self.source, f"{prefix}{key}", "unknown key"))


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _on_failure(value: Any) -> str:
    if value not in (ON_FAILURE_THAW, ON_FAILURE_KILL):
        raise ValueError(f"expected 'thaw' or 'kill', got {value!r}")
    return str(value)


def _cgroup_list(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"expected a cgroup path or a list of them, got {value!r}")
    for item in items:
        if not item.startswith("/"):
            raise ValueError(f"cgroup paths must be absolute, got {item!r}")
        if ".." in item.split("/"):
            raise ValueError(f"cgroup paths may not contain '..', got {item!r}")
    return tuple(items)


def _table(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a table ([{what}]), got {type(value).__name__}")
    return dict(value)


def parse_config(data: dict[str, Any], source: str) -> DaemonConfig:
    issues: list[ConfigIssue] = []
    read = _Reader(source, issues)
    data = dict(data)
    empty: dict[str, Any] = {}
    daemon = read.take(data, "", "daemon", lambda v: _table(v, "daemon"), empty)
    criu_t = read.take(data, "", "criu", lambda v: _table(v, "criu"), dict(empty))
    gpu_t = read.take(data, "", "gpu", lambda v: _table(v, "gpu"), dict(empty))
    slurm_t = read.take(data, "", "slurm", lambda v: _table(v, "slurm"), dict(empty))
    kube_t = read.take(data, "", "kubernetes", lambda v: _table(v, "kubernetes"), dict(empty))
    data_hooks = {"hooks": data.pop("hooks")} if "hooks" in data else {}
    no_guards: list[dict[str, Any]] = []
    guard_list = read.take(data, "", "guard", _guard_array, no_guards)
    read.leftovers(data, "")

    base = DaemonConfig(source=source)
    store = read.take(daemon, "daemon.", "store", lambda v: Path(_str(v)), base.store)
    poll = read.take(daemon, "daemon.", "poll_interval", _wait(positive=True, high=HOUR),
                     base.poll_interval)
    rescan = read.take(daemon, "daemon.", "rescan_interval", _wait(positive=True),
                       base.rescan_interval)
    dry_run = read.take(daemon, "daemon.", "dry_run", _bool, base.dry_run)
    socket = read.take(daemon, "daemon.", "socket", lambda v: Path(_str(v)), base.socket)
    max_size = read.take(daemon, "daemon.", "store_max_size", _size_or_none, base.store_max_size)
    max_age = read.take(daemon, "daemon.", "store_max_age", _duration_or_none, base.store_max_age)
    textfile = read.take(daemon, "daemon.", "metrics_textfile_dir",
                         lambda v: Path(_str(v)) if v != "" else None, None)
    port = read.take(daemon, "daemon.", "metrics_port", _port, 0)
    address = read.take(daemon, "daemon.", "metrics_address", _str, base.metrics_address)
    dbus_notify = read.take(daemon, "daemon.", "dbus_notify", _bool, base.dbus_notify)
    dbus_address = read.take(daemon, "daemon.", "dbus_address", _str, base.dbus_address)
    prekill = read.take(daemon, "daemon.", "oomd_prekill_dir",
                        lambda v: Path(_str(v)) if v != "" else None, None)
    read.leftovers(daemon, "daemon.")
    hooks_t = read.take(data_hooks, "", "hooks", lambda v: _table(v, "hooks"), dict(empty))
    hook_timeout = read.take(hooks_t, "hooks.", "timeout", _wait(positive=True),
                             base.hook_timeout)
    hooks = []
    for event in ("on_checkpoint", "on_restore", "on_kill"):
        command = read.take(hooks_t, "hooks.", event, _str, "")
        if command:
            hooks.append((event, command))
    read.leftovers(hooks_t, "hooks.")

    c = CriuConfig()
    criu = CriuConfig(
        binary=read.take(criu_t, "criu.", "binary", _str, c.binary),
        ghost_limit=read.take(criu_t, "criu.", "ghost_limit", _size(), c.ghost_limit),
        timeout=read.take(criu_t, "criu.", "timeout", _wait(positive=True), c.timeout),
        tcp_close=read.take(criu_t, "criu.", "tcp_close", _bool, c.tcp_close),
        cgroup_limit=read.take(criu_t, "criu.", "cgroup_limit", _size(low=32 << 20),
                               c.cgroup_limit),
    )
    read.leftovers(criu_t, "criu.")
    gpu = _gpu_config(read, gpu_t)
    d = SlurmConfig()
    slurm = SlurmConfig(
        notify=read.take(slurm_t, "slurm.", "notify", lambda v: _choice(v, ("auto", "on", "off")),
                         d.notify),
        scontrol=read.take(slurm_t, "slurm.", "scontrol", _str, d.scontrol),
        after_checkpoint=read.take(slurm_t, "slurm.", "after_checkpoint",
                                   lambda v: _choice(v, ("none", "requeue", "requeuehold")),
                                   d.after_checkpoint),
        grow_memory=read.take(slurm_t, "slurm.", "grow_memory", _factor, d.grow_memory),
    )
    read.leftovers(slurm_t, "slurm.")
    k = KubernetesConfig()
    kubernetes = KubernetesConfig(
        kubelet=read.take(kube_t, "kubernetes.", "kubelet",
                          lambda v: _choice(v, ("auto", "on", "off")), k.kubelet),
        kubelet_url=read.take(kube_t, "kubernetes.", "kubelet_url", _url, k.kubelet_url),
        token_file=read.take(kube_t, "kubernetes.", "token_file", _str, k.token_file),
        ca_file=read.take(kube_t, "kubernetes.", "ca_file", lambda v: str(v), k.ca_file),
    )
    read.leftovers(kube_t, "kubernetes.")

    guards = []
    for index, raw in enumerate(guard_list):
        prefix = f"guard[{index}]."
        table = dict(raw)
        if "cgroup" not in table and "cgroups" not in table and table.get("system") is not True:
            issues.append(ConfigIssue(source, f"{prefix}cgroups",
                                      "missing: which cgroups to guard (or system = true)"))
        if table.get("system") is True and ("cgroup" in table or "cgroups" in table):
            issues.append(ConfigIssue(source, f"{prefix}system",
                                      "a system-wide rule takes no cgroups"))
        none: tuple[str, ...] = ()
        cgroups = read.take(table, prefix, "cgroup", _cgroup_list, none)
        cgroups += read.take(table, prefix, "cgroups", _cgroup_list, none)
        if ("cgroup" in raw or "cgroups" in raw) and not cgroups and not any(
                i.key.startswith(f"{prefix}cgroup") for i in issues):
            issues.append(ConfigIssue(source, f"{prefix}cgroups", "empty: no cgroup to guard"))
        g = GuardConfig(cgroups=())
        system = read.take(table, prefix, "system", _bool, False)
        min_available = read.take(table, prefix, "min_available", _size_or_fraction, 0.10)
        values: dict[str, Any] = {key: read.take(table, prefix, key, convert, getattr(g, key))
                                  for key, convert in GUARD_KEYS.items()}
        spec = GuardConfig(cgroups=cgroups, system=system, min_available=min_available, **values)
        guards.append(spec)
        read.leftovers(table, prefix)

    if issues:
        raise ConfigError(issues)
    return DaemonConfig(source=source, store=store, poll_interval=poll, rescan_interval=rescan,
                        dry_run=dry_run, socket=socket, store_max_size=max_size,
                        store_max_age=max_age, metrics_textfile_dir=textfile, metrics_port=port,
                        metrics_address=address, oomd_prekill_dir=prekill,
                        dbus_notify=dbus_notify, dbus_address=dbus_address, hooks=tuple(hooks),
                        hook_timeout=hook_timeout,
                        criu=criu, gpu=gpu, slurm=slurm, kubernetes=kubernetes,
                        guards=tuple(guards))


def _url(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        raise ValueError(f"expected an http(s):// URL, got {value!r}")
    return value


def _factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 16:
        raise ValueError(f"expected a number from 1 to 16, got {value!r}")
    return float(value)


def _gpu_config(read: _Reader, table: dict[str, Any]) -> GpuConfig:
    d = GpuConfig()
    gpu = GpuConfig(
        engine=read.take(table, "gpu.", "engine", lambda v: _choice(v, GPU_ENGINES), d.engine),
        cuda_checkpoint=read.take(table, "gpu.", "cuda_checkpoint", _str, d.cuda_checkpoint),
        lock_timeout=read.take(table, "gpu.", "lock_timeout", _positive_duration, d.lock_timeout),
        timeout=read.take(table, "gpu.", "timeout", _positive_duration, d.timeout),
        poll_interval=read.take(table, "gpu.", "poll_interval", _positive_duration,
                                d.poll_interval),
        host_margin=read.take(table, "gpu.", "host_margin", _size(), d.host_margin),
    )
    read.leftovers(table, "gpu.")
    if gpu.lock_timeout >= gpu.timeout:
        read.issues.append(ConfigIssue(read.source, "gpu.lock_timeout",
                                       "must be shorter than gpu.timeout"))
    return gpu


def _choice(value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return str(value)


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"expected a TCP port number (0: off), got {value!r}")
    return value


def _positive_duration(value: Any) -> float:
    return bounded_duration(value, positive=True)


def _wait(*, positive: bool = False, high: float | None = None) -> Callable[[Any], float]:
    """A duration the daemon waits or sleeps on: bounded (huge values overflow epoll's and
    the thread waits' timeouts, and are typos anyway)."""
    if high is None:
        return lambda value: bounded_duration(value, positive=positive)
    top = high
    return lambda value: bounded_duration(value, positive=positive, high=top)


def _size(*, low: int = 0) -> Callable[[Any], int]:
    return lambda value: bounded_size(value, low=low)


def _park_deadline(value: Any) -> float:
    """A task must never stay parked for long: 1s to 1h."""
    return bounded_duration(value, low=1.0, high=HOUR)


def _regex_list(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError(f"expected a regular expression or a list of them, got {value!r}")
    compile_patterns(items)
    return tuple(items)


def _size_or_none(value: Any) -> int | None:
    """A size; "0" or "none" means no limit."""
    if isinstance(value, str) and value.strip().lower() in ("none", "0"):
        return None
    size = bounded_size(value)
    return size or None


def _duration_or_none(value: Any) -> float | None:
    if isinstance(value, str) and value.strip().lower() in ("none", "0"):
        return None
    seconds = bounded_duration(value, high=MAX_AGE)
    return seconds or None


def _size_or_fraction(value: Any) -> float | int:
    """'10%' or 0.1 -> fraction of MemTotal; '2G' or an integer -> bytes (never 0)."""
    if isinstance(value, float) or (isinstance(value, str) and value.strip().endswith("%")):
        return parse_fraction(value)
    size = bounded_size(value)
    if size <= 0:
        raise ValueError(f"must be above 0 (a size such as '2G' or a share such as '10%'), "
                         f"got {value!r}")
    return size


def _guard_array(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError("expected [[guard]] tables")
    return value


# Every [[guard]] key but cgroups/system/min_available (read first: they depend on each
# other), with its converter; defaults come from GuardConfig.
GUARD_KEYS: dict[str, Callable[[Any], Any]] = {
    "threshold": parse_fraction, "headroom": _size(), "user_headroom": _bool, "on_failure": _on_failure,
    "events": _bool, "memory_high": _bool, "freeze_cgroup": _bool, "psi": _bool,
    "oom_kill_disable": _bool, "park_deadline": _park_deadline,
    "victim_cgroups": _cgroup_list, "psi_full_avg10": parse_fraction, "auto_restore": _bool,
    "restore_quiet": _wait(), "restore_margin": _size(), "actions": parse_chain,
    "prefer": _regex_list, "avoid": _regex_list, "protect": _regex_list,
    "protect_session_leaders": _bool, "post_action_delay": _wait(),
    "time_to_limit": _bool, "predict_from": parse_fraction, "freeze_deadline": _positive_duration,
    "kill_grace": _wait(), "store_margin": _size(),
    "gpu": lambda v: _choice(v, GPU_PREFERENCES), "gpu_threshold": parse_fraction,
}


def check_cgroup_paths(config: DaemonConfig, layout: CgroupLayout,
                       flag_name: str | None = None) -> None:
    """Every guard's cgroup lies in the memory hierarchy (ConfigError with file and key)."""
    issues = []
    for index, guard in enumerate(config.guards):
        for path in guard.cgroups:
            try:
                open_cgroup(path, layout)
            except ValueError as exc:
                where = flag_name or f"guard[{index}].cgroups"
                issues.append(ConfigIssue(config.source, where, str(exc)))
    if issues:
        raise ConfigError(issues)


def load_config(path: Path | str) -> DaemonConfig:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([ConfigIssue(source, "(file)", f"cannot read: {exc.strerror}")]) from exc
    return load_config_text(text, source)


def load_config_text(text: str, source: str) -> DaemonConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigIssue(source, "(syntax)", str(exc))]) from exc
    return parse_config(data, source)


def embedded_config_text() -> str:
    return resources.files("oomguard").joinpath("data/oomguard.toml").read_text()


def load_embedded_config() -> DaemonConfig:
    return load_config_text(embedded_config_text(), EMBEDDED_CONFIG)
