"""GPU in the pure parts: VRAM in victim ranking, the rule's gpu preference, the `vram` action,
[gpu] config, engine detection, the host-memory budget step and the GPU pressure watch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.config.actions import VRAM, parse_chain
from oomguard.config.loading import GpuConfig, parse_config
from oomguard.daemon.gpuwatch import GpuWatch, on_devices
from oomguard.daemon.guards import SystemGuard
from oomguard.detect.gputhreshold import pressure_reason
from oomguard.gpu.nvml import NvmlSensor
from oomguard.gpu.offload import GpuRefused, move_off_gpu, restored_host_pids
from oomguard.gpu.runtime import (
    ENGINE_CRIU_PLUGIN,
    ENGINE_CUDA_CHECKPOINT,
    ENGINE_NONE,
    GpuSupport,
    detect_gpu,
)
from oomguard.model.errors import ConfigError
from oomguard.policy.preferences import Preferences, apply_preferences
from oomguard.policy.victims import ProcessTree, rank_victims, with_vram
from oomguard.sense.procfs import ProcessInfo
from tests.unit._support import MiB
from tests.unit.fake_pynvml import FakeDevice, FakePynvml, NVMLError_LibraryNotFound

GiB = 1024 * MiB


def proc(pid: int, rss_mib: int, *, ppid: int = 1, nspid: tuple[int, ...] = ()) -> ProcessInfo:
    return ProcessInfo(pid=pid, ppid=ppid, comm=f"p{pid}", state="S", uid=0,
                       rss_bytes=rss_mib * MiB, starttime=pid, session=pid, cmdline=(f"p{pid}",),
                       kernel_thread=False, nspid=nspid or (pid,))


def tree(pid: int, rss_mib: int, vram_mib: int = 0) -> ProcessTree:
    return ProcessTree(root=proc(pid, rss_mib), members=(proc(pid, rss_mib),),
                       vram_bytes=vram_mib * MiB)


# -- ranking -------------------------------------------------------------------------------------

def test_vram_counts_in_the_footprint_and_the_ranking() -> None:
    cpu_only = tree(10, 3000)
    on_gpu = tree(20, 500, vram_mib=8000)
    assert on_gpu.footprint == 8500 * MiB
    assert rank_victims([cpu_only, on_gpu]) == [on_gpu, cpu_only]


def test_with_vram_sums_each_trees_processes() -> None:
    parent, child = proc(10, 100), proc(11, 100, ppid=10)
    trees = [ProcessTree(root=parent, members=(parent, child)), tree(20, 50)]
    counted = with_vram(trees, {11: 2 * GiB, 99: GiB})
    assert [t.vram_bytes for t in counted] == [2 * GiB, 0]
    assert with_vram(trees, {}) == trees


@pytest.mark.parametrize(("preference", "first"), [("neutral", 10), ("prefer", 20), ("avoid", 10)])
def test_gpu_preference_orders_within_a_band(preference: str, first: int) -> None:
    ranked = [tree(10, 4000), tree(20, 100, vram_mib=50)]  # by footprint: 10 first
    ordered = apply_preferences(ranked, Preferences(gpu=preference))
    assert ordered[0].root.pid == first


def test_gpu_avoid_puts_gpu_trees_last() -> None:
    ranked = rank_victims([tree(10, 100, vram_mib=9000), tree(20, 200), tree(30, 300)])
    assert [t.root.pid for t in apply_preferences(ranked, Preferences(gpu="avoid"))] == [30, 20, 10]


# -- config and actions --------------------------------------------------------------------------

def test_vram_action_parses_and_chains() -> None:
    chain = parse_chain(["vram", "checkpoint", "kill"])
    assert [s.kind for s in chain] == [VRAM, "checkpoint", "kill"]
    with pytest.raises(ValueError, match="appears twice"):
        parse_chain(["vram", "vram"])


def test_gpu_section_and_rule_keys() -> None:
    config = parse_config({"gpu": {"engine": "cuda-checkpoint", "lock_timeout": "5s",
                                   "poll_interval": "500ms", "host_margin": "1G"},
                           "guard": [{"cgroups": ["/a"], "gpu": "avoid",
                                      "gpu_threshold": "90%"}]}, "t.toml")
    assert config.gpu == GpuConfig(engine="cuda-checkpoint", lock_timeout=5.0,
                                   poll_interval=0.5, host_margin=GiB)
    assert (config.guards[0].gpu,
            config.guards[0].signal_settings()["gpu_threshold"]) == ("avoid", 0.9)


def test_bad_gpu_config_names_every_key() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"gpu": {"engine": "magic", "lock_timeout": "10m", "colour": "green"},
                      "guard": [{"cgroups": ["/a"], "gpu": "sometimes",
                                 "gpu_threshold": "150%"}]}, "t.toml")
    keys = {issue.key for issue in caught.value.issues}
    assert keys == {"gpu.engine", "gpu.lock_timeout", "gpu.colour", "guard[0].gpu",
                    "guard[0].gpu_threshold"}
    assert all(issue.source == "t.toml" for issue in caught.value.issues)


# -- detection -----------------------------------------------------------------------------------

def fake_tool(tmp_path: Path, actions: bool = True) -> Path:
    path = tmp_path / "cuda-checkpoint"
    usage = "--action <lock|checkpoint|restore|unlock>" if actions else "--toggle --pid PID"
    path.write_text(f"#!{sys.executable}\nprint('Usage: cuda-checkpoint {usage}')\n")
    path.chmod(0o755)
    return path


def sensor(devices: list[FakeDevice] | None = None, missing: bool = False) -> NvmlSensor:
    fake = FakePynvml(devices if devices is not None else [FakeDevice("u0", "GPU", 8 * GiB, 0)],
                      init_error=NVMLError_LibraryNotFound() if missing else None)
    return NvmlSensor(loader=lambda: fake)


def test_detect_prefers_cuda_checkpoint_then_the_plugin(tmp_path: Path) -> None:
    plugins = tmp_path / "criu"
    plugins.mkdir()
    (plugins / "cuda_plugin.so").write_bytes(b"")
    tool = fake_tool(tmp_path)
    both = detect_gpu(cuda_checkpoint=str(tool), sensor=sensor(), plugin_dirs=[str(plugins)])
    assert (both.engine, both.accounting, both.drives_cuda) == (ENGINE_CUDA_CHECKPOINT, True, True)
    assert both.tool is not None and both.tool.actions
    plugin = detect_gpu(engine="criu-plugin", cuda_checkpoint=str(tool), sensor=sensor(),
                        plugin_dirs=[str(plugins)])
    assert (plugin.engine, plugin.drives_cuda) == (ENGINE_CRIU_PLUGIN, False)


def test_detect_without_tool_or_driver(tmp_path: Path) -> None:
    none = detect_gpu(cuda_checkpoint=str(tmp_path / "absent"), sensor=sensor(),
                      plugin_dirs=[str(tmp_path)])
    assert none.accounting and none.engine == ENGINE_NONE and "refused" in none.why
    nodriver = detect_gpu(cuda_checkpoint=str(fake_tool(tmp_path)), sensor=sensor(missing=True))
    assert not nodriver.accounting and "Library Not Found" in nodriver.why
    assert nodriver.tool is not None  # still reported by doctor
    off = detect_gpu(engine="off")
    assert not off.accounting and "off" in off.why and off.vram_by_pid() == {}


# -- the host-memory budget and the CUDA step ---------------------------------------------------

class FakeCgroup:
    def __init__(self, usage: int, limit: int | None) -> None:
        self.usage, self.limit = usage, limit
        self.path = Path("/sys/fs/cgroup/memory/job")

    def snapshot(self) -> Any:
        from oomguard.cgroup.base import MemorySnapshot
        return MemorySnapshot(usage_bytes=self.usage, limit_bytes=self.limit, anon_bytes=self.usage,
                              file_bytes=0, oom_kills=0, under_oom=False)


class RecordingGpu(GpuSupport):
    def __init__(self, vram: dict[int, int], fail: bool = False) -> None:
        super().__init__(accounting=True, engine=ENGINE_CUDA_CHECKPOINT, why="test")
        self.vram, self.fail, self.calls = vram, fail, []  # type: ignore[var-annotated]

    def vram_by_pid(self) -> dict[int, int]:
        return dict(self.vram)

    @property
    def drives_cuda(self) -> bool:
        return True

    def suspend(self, pids: Any) -> None:
        from oomguard.gpu.cudackpt import CudaCheckpointError
        self.calls.append(("suspend", list(pids)))
        if self.fail:
            raise CudaCheckpointError("lock pid 10: timed out")


def run_step(gpu: GpuSupport, cgroup: FakeCgroup | None, available: int) -> tuple[Any, list[Any]]:
    events: list[Any] = []

    def lift(cg: Any, limit: int) -> Any:
        events.append(("lift", limit))
        return lambda: events.append(("lower", limit))

    hold = move_off_gpu(gpu, tree(10, 1024), cgroup, margin=256 * MiB,
                        mem_available=lambda: available, lift=lift,
                        thaw=lambda pids: events.append(("thaw", pids)))
    return hold, events


def test_cuda_step_lifts_a_tight_limit_for_the_copied_vram() -> None:
    gpu = RecordingGpu({10: 2 * GiB})
    hold, events = run_step(gpu, FakeCgroup(usage=3 * GiB, limit=4 * GiB), available=16 * GiB)
    assert hold is not None and (hold.pids, hold.vram_bytes, hold.suspended) == ([10], 2 * GiB, True)
    assert events == [("lift", 3 * GiB + 2 * GiB + 256 * MiB), ("thaw", [10])]
    assert gpu.calls == [("suspend", [10])]


def test_cuda_step_refuses_when_the_machine_cannot_hold_the_vram() -> None:
    gpu = RecordingGpu({10: 40 * GiB})
    with pytest.raises(GpuRefused, match="not enough host memory"):
        run_step(gpu, None, available=16 * GiB)
    assert gpu.calls == []


def test_cuda_step_failure_puts_the_limit_back() -> None:
    gpu = RecordingGpu({10: 2 * GiB}, fail=True)
    events: list[Any] = []
    with pytest.raises(GpuRefused, match="keeps running on it"):
        move_off_gpu(gpu, tree(10, 1024), FakeCgroup(3 * GiB, 4 * GiB), margin=0,
                     mem_available=lambda: 16 * GiB,
                     lift=lambda cg, limit: (events.append("lift"), lambda: events.append("lower"))[1],
                     thaw=lambda pids: None)
    assert events == ["lift", "lower"]


def test_no_gpu_memory_no_step_and_no_engine_refuses() -> None:
    assert run_step(RecordingGpu({99: GiB}), None, 16 * GiB)[0] is None
    engineless = GpuSupport(accounting=True, engine=ENGINE_NONE, why="no cuda-checkpoint found")
    engineless.vram_by_pid = lambda: {10: GiB}  # type: ignore[method-assign]
    with pytest.raises(GpuRefused, match="cannot be checkpointed here"):
        run_step(engineless, None, 16 * GiB)


def test_restored_pids_in_a_pid_namespace_are_mapped_by_inner_pid() -> None:
    restored = [proc(5001, 10, nspid=(5001, 1)), proc(5002, 10, nspid=(5002, 7))]
    assert restored_host_pids([7], restored, pidns=True) == [5002]
    assert restored_host_pids([42], restored, pidns=False) == [42]


# -- the GPU pressure watch ----------------------------------------------------------------------

class RecordingActor:
    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.last_done: dict[str, float] = {}

    def busy(self, name: str) -> bool:
        return False

    def may_act(self, name: str, post_action_delay: float, now: float) -> bool:
        return now - self.last_done.get(name, -1e9) >= post_action_delay

    def start(self, request: Any) -> None:
        self.requests.append(request)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def test_watch_polls_on_its_interval_and_starts_the_rule_on_pressure() -> None:
    from oomguard.config.loading import GuardConfig

    busy = FakeDevice("u0", "H200", 100 * GiB, 95 * GiB, processes=[(10, 60 * GiB), (20, 35 * GiB)])
    calm = FakeDevice("u1", "H200", 100 * GiB, 5 * GiB, processes=[(30, 5 * GiB)])
    gpu = GpuSupport(accounting=True, engine=ENGINE_CUDA_CHECKPOINT, why="test",
                     sensor=sensor([busy, calm]))
    spec = GuardConfig(cgroups=(), system=True, signals=(("gpu_threshold", 0.9),))
    guard = SystemGuard(spec=spec)
    guard.parts = object()  # type: ignore[assignment]
    now = [100.0]
    actor, log = RecordingActor(), Log()
    watch = GpuWatch(gpu, 2.0, actor, None, log, protected=frozenset,  # type: ignore[arg-type]
                     in_cgroups=lambda pid, roots: True, cgroup_of=lambda t: None,
                     clock=lambda: now[0])
    assert GpuWatch.wanted(gpu, [spec]) and not GpuWatch.wanted(gpu, [GuardConfig(cgroups=())])
    watch.tick([guard])
    assert len(actor.requests) == 1 and watch.due_in(now[0]) == 2.0
    event, fields = log.events[0]
    assert event == "threshold.crossed" and fields["devices"] == [0] and fields["source"] == "gpu"
    assert "GPU 0 (H200) memory 95.0GiB of 100.0GiB >= 90%" in actor.requests[0].reason
    watch.tick([guard])  # not due yet: NVML is not read
    assert len(actor.requests) == 1


def test_on_devices_and_reason() -> None:
    fake = FakePynvml([FakeDevice("u0", "A", 10 * GiB, 9 * GiB, processes=[(1, GiB), (2, None)]),
                       FakeDevice("u1", "B", 10 * GiB, 1 * GiB, processes=[(1, 2 * GiB)])])
    snap = NvmlSensor(loader=lambda: fake).snapshot()
    assert on_devices(snap, {0}) == {1: GiB, 2: 0}
    assert on_devices(snap, {0, 1}) == {1: 3 * GiB, 2: 0}
    assert pressure_reason([snap.device(0)], 0.85) == "GPU 0 (A) memory 9.0GiB of 10.0GiB >= 85%"
