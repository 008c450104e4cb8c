"""Configuration: TOML file or command-line flags -> validated, unit-converted dataclasses.

Every problem is collected (file, key, reason) and raised at once as ConfigError; what parses
but looks like a mistake is kept in DaemonConfig.warnings. The dataclasses live in
oomguard.config.schema (their public names are importable from here too), the value kinds in
oomguard.config.values and oomguard.model.quantities. The checks against the machine (cgroups that exist) are
oomguard.cgroup.configchecks, which alone of these reads the cgroup tree: loading a config touches
nothing but the model (the CLI finds the daemon's socket in it before anything else loads).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.config.schema import (
    CHECKSUMS,
    COMPRESSIONS,
    GPU_ENGINES,
    GPU_PREFERENCES,
    CriuConfig,
    DaemonConfig,
    GpuConfig,
    GuardConfig,
    KubernetesConfig,
    PodmanConfig,
    SlurmConfig,
)
from oomguard.config.values import (
    GUARD_KEYS,
    ConfigReader,
    absolute_path,
    argv_list,
    call_rate_value,
    cgroup_list,
    choice,
    factor,
    guard_array,
    mount_namespace_value,
    niceness,
    nonempty_str,
    port,
    table,
    url,
    zstd_level,
)
from oomguard.detect.base import Key
from oomguard.detect.registry import gpu_keys, memory_keys
from oomguard.model.errors import ConfigError, ConfigIssue
from oomguard.model.quantities import (
    DURATION_OR_NONE,
    POSITIVE_DURATION,
    SIZE_SHARE_OR_NONE,
    boolean,
    size,
    wait,
)
from oomguard.model.units import HOUR

__all__ = [
    "DEFAULT_CONFIG_PATH", "EMBEDDED_CONFIG", "GPU_ENGINES", "GPU_PREFERENCES", "GUARD_KEYS",
    "CriuConfig", "DaemonConfig", "GpuConfig", "GuardConfig", "KubernetesConfig", "SlurmConfig",
    "decode_config", "embedded_config_text",
    "load_config", "load_config_text", "load_embedded_config", "parse_config",
]

DEFAULT_CONFIG_PATH = Path("/etc/oomguard/oomguard.toml")
EMBEDDED_CONFIG = "<embedded default>"


def parse_config(data: dict[str, Any], source: str) -> DaemonConfig:
    issues: list[ConfigIssue] = []
    read = ConfigReader(source, issues)
    data = dict(data)
    empty: dict[str, Any] = {}
    daemon = read.take(data, "", "daemon", lambda v: table(v, "daemon"), empty)
    criu_t = read.take(data, "", "criu", lambda v: table(v, "criu"), dict(empty))
    gpu_t = read.take(data, "", "gpu", lambda v: table(v, "gpu"), dict(empty))
    slurm_t = read.take(data, "", "slurm", lambda v: table(v, "slurm"), dict(empty))
    kube_t = read.take(data, "", "kubernetes", lambda v: table(v, "kubernetes"), dict(empty))
    podman_t = read.take(data, "", "podman", lambda v: table(v, "podman"), dict(empty))
    data_hooks = {"hooks": data.pop("hooks")} if "hooks" in data else {}
    no_guards: list[dict[str, Any]] = []
    guard_list = read.take(data, "", "guard", guard_array, no_guards)
    read.know("", "hooks")
    read.leftovers(data, "")

    base = DaemonConfig(source=source)
    settings = _daemon_settings(read, daemon, base)
    hooks_t = read.take(data_hooks, "", "hooks", lambda v: table(v, "hooks"), dict(empty))
    hook_timeout = read.take(hooks_t, "hooks.", "timeout", wait(positive=True),
                             base.hook_timeout)
    hooks = []
    for event in ("on_checkpoint", "on_restore", "on_kill"):
        command = read.take(hooks_t, "hooks.", event, hook_command, "")
        if command:
            hooks.append((event, command))
    read.leftovers(hooks_t, "hooks.")
    criu = _criu_config(read, criu_t)
    gpu = _gpu_config(read, gpu_t)
    slurm = _slurm_config(read, slurm_t)
    kubernetes = _kubernetes_config(read, kube_t)
    podman = _podman_config(read, podman_t)
    guards = tuple(_guard_config(read, issues, source, index, raw)
                   for index, raw in enumerate(guard_list))
    if issues:
        raise ConfigError(issues)
    return DaemonConfig(source=source, hooks=tuple(hooks), hook_timeout=hook_timeout,
                        criu=criu, gpu=gpu, slurm=slurm, kubernetes=kubernetes,
                        podman=podman, guards=guards, warnings=tuple(read.warnings), **settings)


def _daemon_settings(read: ConfigReader, daemon: dict[str, Any],
                     base: DaemonConfig) -> dict[str, Any]:
    """[daemon]: DaemonConfig's fields by name (read in the order the issues are told)."""
    def take(key: str, convert: Callable[[Any], Any], default: Any) -> Any:
        return read.take(daemon, "daemon.", key, convert, default)

    def optional_path(value: Any) -> Path | None:
        return Path(nonempty_str(value)) if value != "" else None

    settings = {
        "store": take("store", lambda v: Path(nonempty_str(v)), base.store),
        "state_dir": take("state_dir", lambda v: Path(absolute_path(v)) if v != "" else None,
                          None),
        "poll_interval": take("poll_interval", wait(positive=True, high=HOUR),
                              base.poll_interval),
        "rescan_interval": take("rescan_interval", wait(positive=True), base.rescan_interval),
        "dry_run": take("dry_run", boolean, base.dry_run),
        "nice": take("nice", niceness, base.nice),
        "socket": take("socket", lambda v: Path(nonempty_str(v)), base.socket),
        "control_idle_timeout": take("control_idle_timeout", POSITIVE_DURATION,
                                     base.control_idle_timeout),
        "control_call_rate": take("control_call_rate", call_rate_value,
                                  base.control_call_rate),
        "store_max_size": take("store_max_size", SIZE_SHARE_OR_NONE, base.store_max_size),
        "store_keep_free": take("store_keep_free", SIZE_SHARE_OR_NONE, base.store_keep_free),
        "store_max_age": take("store_max_age", DURATION_OR_NONE, base.store_max_age),
        "pageout_at_stop": take("pageout_at_stop", lambda v: choice(v, ("keep", "resume")),
                                base.pageout_at_stop),
        "metrics_textfile_dir": take("metrics_textfile_dir", optional_path, None),
        "metrics_port": take("metrics_port", port, 0),
        "metrics_address": take("metrics_address", nonempty_str, base.metrics_address),
        "dbus_notify": take("dbus_notify", boolean, base.dbus_notify),
        "dbus_address": take("dbus_address", nonempty_str, base.dbus_address),
        "oomd_prekill_dir": take("oomd_prekill_dir", optional_path, None),
    }
    read.leftovers(daemon, "daemon.")
    return settings


def _criu_config(read: ConfigReader, criu_t: dict[str, Any]) -> CriuConfig:
    c = CriuConfig()
    criu = CriuConfig(
        binary=read.take(criu_t, "criu.", "binary", nonempty_str, c.binary),
        ghost_limit=read.take(criu_t, "criu.", "ghost_limit", size(), c.ghost_limit),
        timeout=read.take(criu_t, "criu.", "timeout", wait(positive=True), c.timeout),
        tcp_close=read.take(criu_t, "criu.", "tcp_close", boolean, c.tcp_close),
        cgroup_limit=read.take(criu_t, "criu.", "cgroup_limit", size(low=32 << 20),
                               c.cgroup_limit),
        checksum=read.take(criu_t, "criu.", "checksum", lambda v: choice(v, CHECKSUMS),
                           c.checksum),
        compress=read.take(criu_t, "criu.", "compress", lambda v: choice(v, COMPRESSIONS),
                           c.compress),
        compress_level=read.take(criu_t, "criu.", "compress_level", zstd_level,
                                 c.compress_level),
        mount_namespace=read.take(criu_t, "criu.", "mount_namespace", mount_namespace_value,
                                  c.mount_namespace),
    )
    read.leftovers(criu_t, "criu.")
    return criu


def _slurm_config(read: ConfigReader, slurm_t: dict[str, Any]) -> SlurmConfig:
    d = SlurmConfig()
    slurm = SlurmConfig(
        notify=read.take(slurm_t, "slurm.", "notify", lambda v: choice(v, ("auto", "on", "off")),
                         d.notify),
        scontrol=read.take(slurm_t, "slurm.", "scontrol", nonempty_str, d.scontrol),
        after_checkpoint=read.take(slurm_t, "slurm.", "after_checkpoint",
                                   lambda v: choice(v, ("none", "requeue", "requeuehold")),
                                   d.after_checkpoint),
        grow_memory=read.take(slurm_t, "slurm.", "grow_memory", factor, d.grow_memory),
    )
    read.leftovers(slurm_t, "slurm.")
    return slurm


def _kubernetes_config(read: ConfigReader, kube_t: dict[str, Any]) -> KubernetesConfig:
    k = KubernetesConfig()
    kubernetes = KubernetesConfig(
        kubelet=read.take(kube_t, "kubernetes.", "kubelet",
                          lambda v: choice(v, ("auto", "on", "off")), k.kubelet),
        kubelet_url=read.take(kube_t, "kubernetes.", "kubelet_url", url, k.kubelet_url),
        token_file=read.take(kube_t, "kubernetes.", "token_file", nonempty_str, k.token_file),
        ca_file=read.take(kube_t, "kubernetes.", "ca_file", lambda v: str(v), k.ca_file),
    )
    read.leftovers(kube_t, "kubernetes.")
    return kubernetes


def _podman_config(read: ConfigReader, podman_t: dict[str, Any]) -> PodmanConfig:
    p = PodmanConfig()
    podman = PodmanConfig(
        engine=read.take(podman_t, "podman.", "engine",
                         lambda v: choice(v, ("auto", "on", "off")), p.engine),
        command=read.take(podman_t, "podman.", "command", argv_list, p.command),
    )
    read.leftovers(podman_t, "podman.")
    return podman


def _guard_config(read: ConfigReader, issues: list[ConfigIssue], source: str, index: int,
                  raw: dict[str, Any]) -> GuardConfig:
    """One [[guard]] rule (its issues added to `issues`)."""
    prefix = f"guard[{index}]."
    rule = dict(raw)
    if "cgroup" not in rule and "cgroups" not in rule and rule.get("system") is not True:
        issues.append(ConfigIssue(source, f"{prefix}cgroups",
                                  "missing: which cgroups to guard (or system = true)"))
    if rule.get("system") is True and ("cgroup" in rule or "cgroups" in rule):
        issues.append(ConfigIssue(source, f"{prefix}system",
                                  "a system-wide rule takes no cgroups"))
    none: tuple[str, ...] = ()
    cgroups = read.take(rule, prefix, "cgroup", cgroup_list, none)
    cgroups += read.take(rule, prefix, "cgroups", cgroup_list, none)
    if ("cgroup" in raw or "cgroups" in raw) and not cgroups and not any(
            i.key.startswith(f"{prefix}cgroup") for i in issues):
        issues.append(ConfigIssue(source, f"{prefix}cgroups", "empty: no cgroup to guard"))
    g = GuardConfig(cgroups=())
    system = read.take(rule, prefix, "system", boolean, False)
    signals = _signal_values(read, rule, prefix, memory_keys())
    values: dict[str, Any] = {key: read.take(rule, prefix, key, convert, getattr(g, key))
                              for key, convert in GUARD_KEYS.items()}
    # The GPU plug-ins' keys after the rule's own (gpu_threshold's issues come where they
    # always came in a file's list).
    signals += _signal_values(read, rule, prefix, gpu_keys())
    spec = GuardConfig(cgroups=cgroups, system=system, signals=signals, **values)
    read.leftovers(rule, prefix)
    return spec


def _signal_values(read: ConfigReader, rule: dict[str, Any], prefix: str,
                   keys: tuple[Key, ...]) -> tuple[tuple[str, Any], ...]:
    """(key, value) of each detection plug-in's key: the rule's, or the plug-in's default."""
    return tuple((key.name, read.take(rule, prefix, key.name, key.convert, key.default))
                 for key in keys)


def _gpu_config(read: ConfigReader, gpu_t: dict[str, Any]) -> GpuConfig:
    d = GpuConfig()
    gpu = GpuConfig(
        engine=read.take(gpu_t, "gpu.", "engine", lambda v: choice(v, GPU_ENGINES), d.engine),
        cuda_checkpoint=read.take(gpu_t, "gpu.", "cuda_checkpoint", nonempty_str,
                                 d.cuda_checkpoint),
        lock_timeout=read.take(gpu_t, "gpu.", "lock_timeout", POSITIVE_DURATION, d.lock_timeout),
        timeout=read.take(gpu_t, "gpu.", "timeout", POSITIVE_DURATION, d.timeout),
        poll_interval=read.take(gpu_t, "gpu.", "poll_interval", POSITIVE_DURATION,
                                d.poll_interval),
        host_margin=read.take(gpu_t, "gpu.", "host_margin", size(), d.host_margin),
    )
    read.leftovers(gpu_t, "gpu.")
    if gpu.lock_timeout >= gpu.timeout:
        read.issues.append(ConfigIssue(read.source, "gpu.lock_timeout",
                                       "must be shorter than gpu.timeout"))
    return gpu


def hook_command(value: Any) -> str:
    """A hook's shell command; "" (as the shipped config shows it): no hook."""
    return value if value == "" else nonempty_str(value)


def load_config(path: Path | str) -> DaemonConfig:
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigIssue(source, "(file)", f"cannot read: {exc.strerror}")]) from exc
    return load_config_text(decode_config(raw, source), source)


def decode_config(raw: bytes, source: str) -> str:
    """A config file's bytes as text; ConfigError where they are not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue(source, "(file)", f"not UTF-8 text: byte "
                                       f"0x{raw[exc.start]:02x} at offset {exc.start}")]) from None


def load_config_text(text: str, source: str) -> DaemonConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigIssue(source, "(syntax)", str(exc))]) from exc
    except RecursionError:  # tomllib descends once per level of nested arrays or tables
        raise ConfigError([ConfigIssue(source, "(syntax)", "arrays or inline tables nested "
                                       "too deeply")]) from None
    return parse_config(data, source)


def embedded_config_text() -> str:
    # Beside this package on disk (an installed or editable package): read as a file, as
    # importlib.resources would, without its imports (9 ms of every CLI start here).
    beside = Path(__file__).parent.parent / "data" / "oomguard.toml"
    if beside.is_file():
        return beside.read_text()
    from importlib import resources  # from a zip or another loader

    return resources.files("oomguard").joinpath("data/oomguard.toml").read_text()


def load_embedded_config() -> DaemonConfig:
    return load_config_text(embedded_config_text(), EMBEDDED_CONFIG)
