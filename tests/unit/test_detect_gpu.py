"""The GPU detection plug-ins (oomguard.detect.gputhreshold, registry.GPU_SIGNALS): the shipped
`gpu_threshold` judges a read of the GPUs' memory and says its words on the startup line; a
GPU plug-in oomguard does not ship (a device with little memory left, in bytes) is added with
one registry line: the config takes its key, the startup line says it, and the GPU watch reads
NVML for it and acts on its verdict."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.config.loading import GuardConfig, load_config_text
from oomguard.daemon.gpuwatch import GpuWatch
from oomguard.daemon.guardlines import guard_line
from oomguard.daemon.guards import CgroupGuard, SystemGuard
from oomguard.detect import registry
from oomguard.detect.base import GpuReadings, GpuVerdict, Key, Settings
from oomguard.detect.gputhreshold import GpuThreshold, devices_at, pressure_reason
from oomguard.gpu.runtime import ENGINE_CUDA_CHECKPOINT, GpuSupport
from oomguard.model.errors import ConfigError
from oomguard.model.quantities import size
from tests.unit.fake_pynvml import FakeDevice
from tests.unit.test_gpu_policy import Log, RecordingActor, sensor

GiB = 1 << 30
SYSTEM = "[[guard]]\nsystem = true\n"


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class Read:
    devices: tuple[Device, ...]


READ = Read((Device(0, "A", 10 * GiB, 9 * GiB), Device(1, "B", 10 * GiB, 5 * GiB),
             Device(2, "C", 0, 0), Device(3, "D", 10 * GiB, 10 * GiB)))


def test_the_shipped_gpu_plugin_is_the_threshold() -> None:
    assert [signal.name for signal in registry.GPU_SIGNALS] == ["gpu_threshold"]
    assert [key.name for key in registry.gpu_keys()] == ["gpu_threshold"]
    assert registry.defaults()["gpu_threshold"] is None
    assert GuardConfig(cgroups=()).signal_settings()["gpu_threshold"] is None


@pytest.mark.parametrize(("share", "indexes"), [(0.5, [0, 1, 3]), (0.9, [0, 3]), (1.0, [3])])
def test_the_devices_at_or_over_the_share(share: float, indexes: list[int]) -> None:
    """A device that reports no memory (C) is never pressed."""
    assert [d.index for d in devices_at(READ.devices, share)] == indexes


def test_the_threshold_judges_a_read() -> None:
    plugin = GpuThreshold()
    verdict = plugin.judge(READ, {"gpu_threshold": 0.9})
    assert verdict == GpuVerdict((0, 3), "GPU 0 (A) memory 9.0GiB of 10.0GiB >= 90%; "
                                         "GPU 3 (D) memory 10.0GiB of 10.0GiB >= 90%")
    assert plugin.judge(Read(READ.devices[1:3]), {"gpu_threshold": 0.9}) is None
    assert plugin.judge(READ, {"gpu_threshold": None}) is None  # off: nothing judged
    assert plugin.on({"gpu_threshold": 0.9}) and not plugin.on({"gpu_threshold": None})
    assert pressure_reason([READ.devices[1]], 0.5) == "GPU 1 (B) memory 5.0GiB of 10.0GiB >= 50%"


def test_the_threshold_is_said_on_the_startup_line() -> None:
    assert GpuThreshold().describe({"gpu_threshold": 0.95}) == "when a GPU's memory is 95% used"
    assert GpuThreshold().describe({"gpu_threshold": None}) is None
    spec = load_config_text(SYSTEM + 'gpu_threshold = "95%"\n', "c.toml").guards[0]
    line = guard_line(SystemGuard(spec=spec, detection="MemAvailable (adaptive polling)"),
                      None, 32 * GiB)
    assert line.endswith("(3.2 GiB), or when a GPU's memory is 95% used, "
                         "MemAvailable (adaptive polling)")
    spec = load_config_text('[[guard]]\ncgroup = "/jobs"\ngpu_threshold = "90%"\n',
                            "c.toml").guards[0]
    guard = CgroupGuard(spec=spec, cgroup=SimpleNamespace(path=Path("/jobs")),  # type: ignore[arg-type]
                        detection="v2 events")
    assert guard_line(guard, None) == ("guarding /jobs: no memory limit: nothing to act on "
                                       "until one is set, or when a GPU's memory is 90% used")


def test_a_bad_threshold_names_the_key_with_its_hint() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(SYSTEM + "gpu_threshold = 95\n", "c.toml")
    (issue,) = caught.value.issues
    assert (issue.source, issue.key) == ("c.toml", "guard[0].gpu_threshold")
    assert issue.reason.endswith('(did you mean "95%"?)')


# -- a GPU plug-in added with one registry line ----------------------------------------------------

class GpuFreeBelow:
    """A GPU plug-in a user would add: act when a device has less than `gpu_min_free` free."""

    name: str = "gpu_min_free"
    keys: tuple[Key, ...] = (Key("gpu_min_free", size(), None),)

    def on(self, settings: Settings) -> bool:
        return settings["gpu_min_free"] is not None

    def judge(self, readings: GpuReadings, settings: Settings) -> GpuVerdict | None:
        floor = settings["gpu_min_free"]
        low = [d for d in readings.devices if floor is not None and d.total_bytes > 0
               and d.total_bytes - d.used_bytes < floor]
        if not low:
            return None
        return GpuVerdict(tuple(d.index for d in low),
                          "; ".join(f"GPU {d.index} has little memory free" for d in low))

    def describe(self, settings: Settings) -> str | None:
        floor = settings["gpu_min_free"]
        return None if floor is None else "when a GPU has little memory free"


@pytest.fixture
def with_gpu_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "GPU_SIGNALS", (*registry.GPU_SIGNALS, GpuFreeBelow()))


def test_a_new_gpu_plugin_is_one_registry_line(with_gpu_plugin: None) -> None:
    spec = load_config_text(SYSTEM + 'gpu_min_free = "2G"\n', "c.toml").guards[0]
    assert spec.signal_settings()["gpu_min_free"] == 2 * GiB
    assert spec.signal_settings()["gpu_threshold"] is None
    line = guard_line(SystemGuard(spec=spec), None, 32 * GiB)
    assert line.endswith(", or when a GPU has little memory free")

    tight = FakeDevice("u0", "H200", 100 * GiB, 99 * GiB, processes=[(10, 99 * GiB)])
    roomy = FakeDevice("u1", "H200", 100 * GiB, 5 * GiB, processes=[(30, 5 * GiB)])
    gpu = GpuSupport(accounting=True, engine=ENGINE_CUDA_CHECKPOINT, why="test",
                     sensor=sensor([tight, roomy]))
    assert GpuWatch.wanted(gpu, [spec]) and not GpuWatch.wanted(gpu, [GuardConfig(cgroups=())])
    guard = SystemGuard(spec=spec)
    guard.parts = object()  # type: ignore[assignment]
    actor, log = RecordingActor(), Log()
    watch = GpuWatch(gpu, 2.0, actor, None, log, protected=frozenset,  # type: ignore[arg-type]
                     in_cgroups=lambda pid, roots: True, cgroup_of=lambda t: None,
                     clock=lambda: 100.0)
    watch.tick([guard])
    event, fields = log.events[0]
    assert event == "threshold.crossed" and fields["devices"] == [0]
    assert fields["reason"] == "GPU 0 has little memory free"
    assert len(actor.requests) == 1 and actor.requests[0].still_pressing()
