"""oomguard.gpu.nvml over a fake pynvml: snapshots, decoding, NVML errors, lazy init, pure helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oomguard.detect.gputhreshold import devices_at
from oomguard.gpu.nvml import (
    GpuDevice,
    GpuProcess,
    GpuSnapshot,
    GpuUnavailable,
    NvmlSensor,
    tree_vram,
)
from tests.unit.fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    FakeDevice,
    FakePynvml,
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
)

GiB = 1 << 30
MiB = 1 << 20


def two_gpus() -> FakePynvml:
    return FakePynvml([
        FakeDevice("GPU-aaaa", "NVIDIA H200", 141 * GiB, 100 * GiB,
                   [(1001, 60 * GiB), (1002, None)]),
        FakeDevice(b"GPU-bbbb", b"NVIDIA A100-SXM4-80GB", 80 * GiB, 10 * GiB,
                   [(1001, 4 * GiB), (1003, 512 * MiB)]),
    ], driver_version=b"570.86.15")


def sensor_over(fake: FakePynvml) -> NvmlSensor:
    return NvmlSensor(loader=lambda: fake)


def test_module_imports_without_pynvml() -> None:
    code = ("import sys; sys.modules['pynvml'] = None; import oomguard.gpu.nvml, oomguard.gpu.cudackpt, "
            "oomguard.gpu.budget; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_snapshot_of_two_devices() -> None:
    snap = sensor_over(two_gpus()).snapshot()
    assert snap.driver_version == "570.86.15"
    assert snap.devices == (
        GpuDevice(0, "GPU-aaaa", "NVIDIA H200", 141 * GiB, 100 * GiB),
        GpuDevice(1, "GPU-bbbb", "NVIDIA A100-SXM4-80GB", 80 * GiB, 10 * GiB),
    )
    assert snap.processes == (
        GpuProcess(1001, 0, 60 * GiB),
        GpuProcess(1002, 0, None),
        GpuProcess(1001, 1, 4 * GiB),
        GpuProcess(1003, 1, 512 * MiB),
    )
    assert snap.device(1).uuid == "GPU-bbbb"
    with pytest.raises(KeyError):
        snap.device(2)


def test_bytes_and_str_both_decode() -> None:
    fake = FakePynvml([FakeDevice(b"GPU-\xc3\xa9", "plain str", GiB, 0)], driver_version="550.54.14")
    snap = sensor_over(fake).snapshot()
    assert snap.devices[0].uuid == "GPU-é"
    assert snap.devices[0].name == "plain str"
    assert snap.driver_version == "550.54.14"


def test_vram_by_pid_sums_devices_and_counts_unknown_as_zero() -> None:
    snap = sensor_over(two_gpus()).snapshot()
    assert snap.vram_by_pid() == {1001: 64 * GiB, 1002: 0, 1003: 512 * MiB}


def test_not_supported_process_list_on_one_device_keeps_the_others() -> None:
    fake = two_gpus()
    fake.devices[0].processes = NVMLError_NotSupported()
    snap = sensor_over(fake).snapshot()
    assert len(snap.devices) == 2
    assert snap.processes == (GpuProcess(1001, 1, 4 * GiB), GpuProcess(1003, 1, 512 * MiB))


def test_other_process_list_errors_fail_the_snapshot() -> None:
    fake = two_gpus()
    fake.devices[1].processes = NVMLError_NoPermission()
    with pytest.raises(GpuUnavailable, match="nvmlDeviceGetComputeRunningProcesses: Insufficient Perm"):
        sensor_over(fake).snapshot()


def test_device_error_is_readable_and_carries_the_code() -> None:
    fake = two_gpus()
    fake.devices[1].memory_error = NVMLError_GpuIsLost()
    with pytest.raises(GpuUnavailable) as info:
        sensor_over(fake).snapshot()
    assert info.value.code == NVML_ERROR_GPU_IS_LOST
    assert "nvmlDeviceGetMemoryInfo" in info.value.reason
    assert "fell off the bus" in info.value.reason


def test_library_missing() -> None:
    def loader() -> object:
        raise ImportError("No module named 'pynvml'")

    sensor = NvmlSensor(loader=loader)
    ok, reason = sensor.available()
    assert not ok
    assert "not installed" in reason
    with pytest.raises(GpuUnavailable, match="pynvml"):
        sensor.snapshot()
    sensor.close()  # nothing initialised: a no-op


def test_default_loader_imports_pynvml_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    ok, reason = NvmlSensor().available()
    assert not ok
    assert "nvidia-ml-py" in reason


def test_default_loader_uses_the_installed_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = two_gpus()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert NvmlSensor().available() == (True, "NVIDIA driver 570.86.15")


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (NVMLError_DriverNotLoaded(), "driver not loaded"),
        (NVMLError_LibraryNotFound(), "libnvidia-ml.so not found"),
    ],
)
def test_init_failure(error: NVMLError, words: str) -> None:
    fake = FakePynvml(init_error=error)
    sensor = sensor_over(fake)
    ok, reason = sensor.available()
    assert not ok
    assert reason.startswith("nvmlInit: ")
    assert words in reason.lower()
    with pytest.raises(GpuUnavailable) as info:
        sensor.snapshot()
    assert info.value.code == error.value
    sensor.close()
    assert fake.shutdown_calls == 0


def test_driver_not_loaded_code() -> None:
    sensor = sensor_over(FakePynvml(init_error=NVMLError_DriverNotLoaded()))
    with pytest.raises(GpuUnavailable) as info:
        sensor.snapshot()
    assert info.value.code == NVML_ERROR_DRIVER_NOT_LOADED


def test_init_happens_once_and_close_shuts_down() -> None:
    fake = two_gpus()
    loads = []

    def loader() -> FakePynvml:
        loads.append(1)
        return fake

    sensor = NvmlSensor(loader=loader)
    assert fake.init_calls == 0  # lazy: nothing at construction
    assert sensor.available()[0]
    sensor.snapshot()
    sensor.snapshot()
    assert (len(loads), fake.init_calls) == (1, 1)
    sensor.close()
    sensor.close()
    assert fake.shutdown_calls == 1
    sensor.snapshot()  # initialises again after close
    assert fake.init_calls == 2


def test_init_is_retried_after_a_failure() -> None:
    fake = two_gpus()
    fake.init_error = NVMLError_DriverNotLoaded()
    sensor = sensor_over(fake)
    assert not sensor.available()[0]
    fake.init_error = None  # the driver got loaded
    assert sensor.available() == (True, "NVIDIA driver 570.86.15")


def test_unrelated_exceptions_propagate() -> None:
    fake = two_gpus()

    def broken() -> int:
        raise RuntimeError("bug")

    fake.nvmlDeviceGetCount = broken  # type: ignore[method-assign]
    sensor = sensor_over(fake)
    with pytest.raises(RuntimeError, match="bug"):
        sensor.snapshot()
    fake.nvmlSystemGetDriverVersion = broken  # type: ignore[method-assign,assignment]
    assert sensor.available() == (False, "NVML failed: RuntimeError('bug')")  # never raises


# -- pure helpers ---------------------------------------------------------------------------------

SNAP = GpuSnapshot(
    driver_version="570.86.15",
    devices=(GpuDevice(0, "GPU-a", "H200", 100 * GiB, 95 * GiB),
             GpuDevice(1, "GPU-b", "H200", 100 * GiB, 90 * GiB),
             GpuDevice(2, "GPU-c", "H200", 100 * GiB, 10 * GiB),
             GpuDevice(3, "GPU-mig", "odd", 0, 0)),
    processes=(GpuProcess(10, 0, 50 * GiB), GpuProcess(11, 0, None), GpuProcess(10, 1, 40 * GiB),
               GpuProcess(12, 2, 10 * GiB)),
)


@pytest.mark.parametrize(
    ("threshold", "indexes"),
    [(0.95, [0]), (0.9, [0, 1]), (0.91, [0]), (0.0, [0, 1, 2]), (1.0, [])],
)
def test_devices_over(threshold: float, indexes: list[int]) -> None:
    assert [d.index for d in devices_at(SNAP.devices, threshold)] == indexes


def test_tree_vram() -> None:
    assert tree_vram(SNAP, [10, 11]) == 90 * GiB
    assert tree_vram(SNAP, iter([10, 10, 12, 999])) == 100 * GiB  # duplicates once, strangers 0
    assert tree_vram(SNAP, []) == 0


def test_without_the_drivers_library_pynvml_is_not_imported() -> None:
    """The default loader dlopens libnvidia-ml first: where it is missing, the reason is
    pynvml's own (error 12) and pynvml stays unimported (~3 MiB of the daemon's memory)."""
    script = (
        "import sys\n"
        "from oomguard.gpu import nvml\n"
        "sensor = nvml.NvmlSensor(loader=lambda: nvml._import_pynvml('libnvidia-ml-missing.so.1'))\n"
        "print(sensor.available())\n"
        "print('pynvml' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.splitlines() == [
        "(False, 'nvmlInit: NVML Shared Library Not Found; libnvidia-ml.so not found (no NVIDIA "
        "driver installed?) (NVML error 12)')",
        "False"]
