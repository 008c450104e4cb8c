"""The daemon's start-up lines: one per guard in words, and the GPU in a few words."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from oomguard.config.actions import parse_chain
from oomguard.config.loading import GuardConfig
from oomguard.daemon.guardlines import gpu_summary, guard_line
from oomguard.daemon.guards import CgroupGuard, SystemGuard
from oomguard.gpu.runtime import GpuSupport
from oomguard.model.units import size_text

MiB = 1 << 20
GiB = 1 << 30
JOBS = "/sys/fs/cgroup/memory/jobs"


def cgroup_guard(spec: GuardConfig, detection: str) -> CgroupGuard:
    return CgroupGuard(spec=spec, cgroup=SimpleNamespace(path=Path(JOBS)),  # type: ignore[arg-type]
                       detection=detection)


def test_sizes() -> None:
    assert [size_text(n) for n in (340 * MiB, 400 * MiB, 1536 * MiB, 32 * GiB)] == [
        "340 MiB", "400 MiB", "1.5 GiB", "32.0 GiB"]


def test_a_v1_cgroup_guard_in_one_line() -> None:
    guard = cgroup_guard(GuardConfig(cgroups=(JOBS,), threshold=0.85),
                         "v1 memory threshold eventfd + OOM notification")
    assert guard_line(guard, 400 * MiB) == (
        f"guarding {JOBS}: act (checkpoint, then pageout) at 85% of 400 MiB (340 MiB), "
        "v1 memory threshold eventfd + OOM notification")


def test_actions_prediction_and_dry_run_are_said() -> None:
    spec = GuardConfig(cgroups=(JOBS,), threshold=0.9,
                       signals=(("time_to_limit", True), ("predict_from", 0.6)),
                       actions=parse_chain(["checkpoint", "kill"]))
    line = guard_line(cgroup_guard(spec, "polling every 100ms"), 2 * GiB, dry_run=True)
    assert line.startswith(f"guarding {JOBS}: act (checkpoint, then kill) at 90% of 2.0 GiB "
                           "(1.8 GiB), earlier when growth would reach the limit first "
                           "(watched from 60%), polling every 100ms")
    assert line.endswith("(dry run: decides and logs, touches nothing)")


def test_a_cgroup_without_a_limit_says_there_is_nothing_to_act_on() -> None:
    guard = cgroup_guard(GuardConfig(cgroups=(JOBS,)), "none (no memory limit)")
    assert guard_line(guard, None) == (
        f"guarding {JOBS}: no memory limit: nothing to act on until one is set")


def test_a_system_rule_says_the_floor_in_bytes() -> None:
    spec = GuardConfig(cgroups=(), system=True,
                       signals=(("min_available", 0.10), ("psi_full_avg10", 0.2)),
                       victim_cgroups=("/user.slice",))
    guard = SystemGuard(spec=spec, detection="MemAvailable (adaptive polling)")
    assert guard_line(guard, None, 32 * GiB) == (
        "guarding the system: act (checkpoint, then pageout) when MemAvailable is at or below 10% of "
        "32.0 GiB (3.2 GiB) or memory pressure (full avg10) reaches 20%, on processes in "
        "/user.slice, MemAvailable (adaptive polling)")
    fixed = SystemGuard(spec=GuardConfig(cgroups=(), system=True,
                                                  signals=(("min_available", 512 * MiB),)),
                        detection="MemAvailable (adaptive polling)")
    assert "at or below 512 MiB, MemAvailable" in guard_line(fixed, None, 32 * GiB)


NO_DRIVER = ("nvmlInit: NVML Shared Library Not Found; libnvidia-ml.so not found (no NVIDIA "
             "driver installed?) (NVML error 12)")


def test_no_driver_is_a_few_words_without_the_probe_text() -> None:
    assert gpu_summary(GpuSupport.off(NO_DRIVER)) == ("none (no NVIDIA driver)", None)
    assert gpu_summary(GpuSupport.off("nvmlInit: Driver Not Loaded (NVML error 9)")) == (
        "none (no NVIDIA driver)", None)
    assert gpu_summary(GpuSupport.off('off in the config ([gpu] engine = "off")')) == (
        "off (config)", None)
    assert gpu_summary(GpuSupport.off("nvidia-ml-py (pynvml) is not installed: x")) == (
        "none (nvidia-ml-py not installed)", None)


def test_a_gpu_that_fails_otherwise_keeps_its_detail() -> None:
    why = "nvmlInit: Insufficient Permissions (NVML error 4)"
    assert gpu_summary(GpuSupport.off(why)) == ("none", why)
    working = GpuSupport(accounting=True, engine="cuda-checkpoint", why="NVIDIA driver 550.54")
    assert gpu_summary(working) == ("cuda-checkpoint", "NVIDIA driver 550.54")
