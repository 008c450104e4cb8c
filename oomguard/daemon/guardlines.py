"""What the daemon says when it starts, in words: one line per guard, as earlyoom's (what is
guarded, at what level, with which actions, how a crossing is detected), and the GPU support
in a few words (the probe's long text only where a GPU could be used)."""

from __future__ import annotations

import re

from oomguard.daemon.guards import CgroupGuard, Guard
from oomguard.detect.registry import cgroup_descriptions, descriptions, gpu_descriptions
from oomguard.gpu.runtime import GpuSupport
from oomguard.model.units import size_text
from oomguard.respond.actor import RuleParts, rule_parts

# NVML's "library not found" (12) and "driver not loaded" (9): no NVIDIA driver at all.
_NO_DRIVER = re.compile(r"NVML error (9|12)\b|libnvidia-ml\.so not found")


def _actions(parts: RuleParts | None, guard: Guard) -> str:
    chain = (parts or rule_parts(guard.spec)).chain
    return ", then ".join(str(step) for step in chain)


def guard_line(guard: Guard, limit: int | None, mem_total: int = 0,
               dry_run: bool = False) -> str:
    """'guarding /sys/fs/cgroup/memory/jobs: act (checkpoint) at 85% of 400 MiB (340 MiB),
    v1 memory threshold eventfd + OOM notification'. `limit`: the cgroup's memory limit;
    `mem_total`: MemTotal, for a system rule."""
    spec = guard.spec
    actions = _actions(guard.parts, guard)
    if isinstance(guard, CgroupGuard):
        if limit is None:
            level = "no memory limit: nothing to act on until one is set"
        else:
            level = (f"act ({actions}) at {spec.threshold:.0%} of {size_text(limit)} "
                     f"({size_text(limit * spec.threshold)})")
            for words in cgroup_descriptions(spec.signal_settings()):
                level += f", {words}"
        where = guard.name
    else:
        level = f"act ({actions}) when " + " or ".join(
            descriptions(spec.signal_settings(), mem_total))
        if spec.victim_cgroups:
            level += f", on processes in {', '.join(spec.victim_cgroups)}"
        where = "the system"
    for words in gpu_descriptions(spec.signal_settings()):
        level += f", or {words}"
    line = f"guarding {where}: {level}"
    if guard.detection and (limit is not None or not isinstance(guard, CgroupGuard)):
        line += f", {guard.detection}"
    return line + (" (dry run: decides and logs, touches nothing)" if dry_run else "")


def gpu_summary(gpu: GpuSupport) -> tuple[str, str | None]:
    """(a few words, the probe's detail or None): "none (no NVIDIA driver)" on a machine
    without one, with no detail; the engine and the detail where a GPU is there."""
    if gpu.accounting:
        return gpu.engine, gpu.why
    if gpu.why.startswith("off in the config"):
        return "off (config)", None
    if _NO_DRIVER.search(gpu.why):
        return "none (no NVIDIA driver)", None
    if "nvidia-ml-py (pynvml) is not installed" in gpu.why:
        return "none (nvidia-ml-py not installed)", None
    return "none", gpu.why
