"""`oomguard doctor`, the parts that depend on the config: which config the CLI read, whether
each configured guard's cgroup exists and has a limit, and whether the daemon answers on the
configured socket. The machine's own checks are in oomguard.cli.doctor."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from oomguard.cgroup.mounts import CgroupLayout, open_cgroup, read_layout
from oomguard.cli.doctor import Check, run_checks
from oomguard.config.discovery import CliConfig
from oomguard.config.loading import DEFAULT_CONFIG_PATH, EMBEDDED_CONFIG, DaemonConfig, GuardConfig
from oomguard.control.client import ControlClient, DaemonUnavailable
from oomguard.gpu.runtime import detect_gpu
from oomguard.model.errors import OomguardError
from oomguard.model.units import format_size
from oomguard.observe.rendering import budget_text
from oomguard.sense.procevents import EventSource, ProcEvents
from oomguard.store.budget import StoreBudget
from oomguard.store.checkpoints import Store

DAEMON_TIMEOUT = 10.0  # the Status verb answers at once; a wedged daemon is reported, not waited on
START_HINT = "oomguard install-units, then systemctl enable --now oomguard"


def config_check(found: CliConfig) -> Check:
    choice = found.choice
    if found.fallback is not None:
        return Check("config", False, f"{found.fallback}: uid {os.geteuid()} reads the embedded "
                     "default instead (its socket, its store)",
                     "run doctor as root to check the service's config", warn_only=True)
    if choice.path is None:
        return Check("config", True, "the embedded default (no /etc/oomguard/oomguard.toml: "
                     "oomguard install-units writes one)")
    rules = len(found.config.guards)
    return Check("config", True, f"{choice.path} (from {choice.named_by}), "
                 f"{rules} guard rule{'' if rules == 1 else 's'}")


def _system_rule(index: int, guard: GuardConfig) -> Check:
    floor = guard.min_available
    at = f"{floor:.0%} of MemTotal" if isinstance(floor, float) else format_size(floor)
    where = ", ".join(guard.victim_cgroups) or "any process"
    return Check(f"guard[{index}]", True, f"system rule: acts when MemAvailable falls to {at} "
                 f"(victims: {where})")


def _cgroup_rule(index: int, guard: GuardConfig, path: str, layout: CgroupLayout,
                 source: str) -> Check:
    name = f"guard[{index}]"
    fix = f"fix guard[{index}].cgroups in {source}"
    try:
        cgroup = open_cgroup(path, layout)
    except ValueError as exc:  # the daemon refuses to start on this
        return Check(name, False, f"{path}: {exc}", fix)
    try:
        present = cgroup.exists()
        limit = cgroup.limit() if present else None
    except OSError:  # gone between the two reads
        present, limit = False, None
    if not present:
        return Check(name, False, f"{path}: absent (the daemon guards it once it appears)",
                     f"create the cgroup, or {fix}", warn_only=True)
    if limit is None:
        return Check(name, False, f"{path}: no memory limit, so this guard never acts",
                     "set the cgroup's limit (v1 memory.limit_in_bytes, v2 memory.max; "
                     "systemd: MemoryMax=)", warn_only=True)
    return Check(name, True, f"{path}: limit {format_size(limit)}, acts at "
                 f"{guard.threshold:.0%} ({format_size(limit * guard.threshold)})")


def guard_checks(config: DaemonConfig, layout: CgroupLayout) -> list[Check]:
    """One line per guarded cgroup (and per system rule); a warning when there is none."""
    if not config.guards:
        where = str(DEFAULT_CONFIG_PATH) if config.source == EMBEDDED_CONFIG else config.source
        return [Check("guards", False, f"none in {config.source}: nothing is watched",
                      f"add a [[guard]] rule to {where} (the shipped config has commented "
                      "examples)", warn_only=True)]
    checks = []
    for index, guard in enumerate(config.guards):
        if guard.system:
            checks.append(_system_rule(index, guard))
            continue
        checks.extend(_cgroup_rule(index, guard, path, layout, config.source)
                      for path in guard.cgroups)
    return checks


def daemon_check(socket: Path) -> Check:
    """Does a daemon answer on `socket` (a Status call, as any user may make)?"""
    try:
        with ControlClient(socket) as client:
            client.sock.settimeout(DAEMON_TIMEOUT)
            status = client.call("Status").get("status", {})
    except DaemonUnavailable:
        return Check("daemon", False, f"no daemon answers on {socket}: nothing is guarded",
                     START_HINT, warn_only=True)
    except (OomguardError, OSError, ValueError) as exc:
        return Check("daemon", False, f"{socket} does not answer: {exc}",
                     "see `journalctl -u oomguard`", warn_only=True)
    watched = len(status.get("guards", []))
    return Check("daemon", True, f"answers on {socket} (pid {status.get('pid')}, "
                 f"{watched} guard{'' if watched == 1 else 's'})")


def budget_check(config: DaemonConfig) -> Check:
    """The store's use against its budget (store_max_size, store_keep_free)."""
    budget = StoreBudget(Store(config.store), config.store_max_size, config.store_keep_free)
    try:
        reading = budget.reading()
    except OomguardError as exc:
        return Check("store budget", False, str(exc), warn_only=True)
    figures = {**reading.fields(), "over": reading.over()}
    if config.store_max_size is None and config.store_keep_free is None:
        return Check("store budget", False, f"none: {budget_text(figures)}",
                     "set store_max_size and store_keep_free: a busy store can fill the disk",
                     warn_only=True)
    return Check("store budget", not reading.over(), budget_text(figures),
                 "only restored checkpoints are pruned: restore or `oomguard forget` some, "
                 "or give the store more room", warn_only=True)


def doctor_checks(config: DaemonConfig, found: CliConfig, socket: Path | None = None,
                  proc_root: str = "/proc",
                  open_events: Callable[[], EventSource] = ProcEvents) -> list[Check]:
    """Everything `oomguard doctor` prints: the machine (store, CRIU, process events and GPU
    as configured), then the config, its guards and the daemon."""
    gpu = None if config.gpu.engine == "off" else detect_gpu(
        config.gpu.engine, config.gpu.cuda_checkpoint, lock_timeout=config.gpu.lock_timeout,
        timeout=config.gpu.timeout)
    checks = run_checks(config.store, config.criu.binary, proc_root, gpu=gpu,
                        gpu_off=config.gpu.engine == "off", open_events=open_events)
    checks.append(budget_check(config))
    checks.append(config_check(found))
    checks.extend(guard_checks(config, read_layout(proc_root)))
    checks.append(daemon_check(socket or config.socket))
    return checks
