"""A stand-in for the `pynvml` module (nvidia-ml-py): the functions NvmlSensor calls, NVML's error
classes with their `.value` codes, configurable devices and processes, init/shutdown counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(value)

    def __str__(self) -> str:
        return _STRINGS.get(self.value, f"NVML Error with code {self.value}")


_Error = NVMLError  # FakePynvml's own `NVMLError` attribute hides the name in its body


# The NVMLError_* names are pynvml's.
class NVMLError_Uninitialized(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_UNINITIALIZED)


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_NoPermission(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NO_PERMISSION)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_DRIVER_NOT_LOADED)


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND)


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_GPU_IS_LOST)


@dataclass
class FakeDevice:
    uuid: str | bytes
    name: str | bytes
    total: int
    used: int
    # (pid, usedGpuMemory or None); or an NVMLError to raise from nvmlDeviceGetComputeRunningProcesses
    processes: list[tuple[int, int | None]] | NVMLError = field(default_factory=list)
    memory_error: NVMLError | None = None


class FakePynvml:
    """Configure `devices`, `driver_version`, `init_error`; read `init_calls`, `shutdown_calls`."""

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND

    def __init__(self, devices: list[FakeDevice] | None = None, driver_version: str | bytes = "570.86.15",
                 init_error: _Error | None = None) -> None:
        self.devices = devices if devices is not None else []
        self.driver_version = driver_version
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.initialised = False

    def _check(self) -> None:
        if not self.initialised:
            raise NVMLError_Uninitialized()

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        self._check()
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._check()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._check()
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str | bytes:
        self._check()
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        self._check()
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> SimpleNamespace:
        self._check()
        if handle.memory_error is not None:
            raise handle.memory_error
        return SimpleNamespace(total=handle.total, used=handle.used, free=handle.total - handle.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        self._check()
        if isinstance(handle.processes, NVMLError):
            raise handle.processes
        return [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in handle.processes]
