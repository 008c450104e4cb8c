"""GPU sensor: NVML (nvidia-ml-py, import name `pynvml`) read into frozen dataclasses.

pynvml is loaded lazily through an injectable loader, and NVML initialised once, on first use: this
module imports, and `NvmlSensor.available()` answers, on machines without the library, the driver
or a GPU. NVML reports host PIDs (also when oomguard runs in a container with its own PID namespace).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from oomguard.model.errors import OomguardError

# NVML return codes (nvml.h `nvmlReturn_t`); pynvml exposes them as NVML_ERROR_* and NVMLError.value.
NVML_ERROR_NOT_SUPPORTED = 3
_HINTS = {
    2: "invalid argument",
    3: "not supported on this device",
    4: "no permission",
    9: "NVIDIA kernel driver not loaded",
    12: "libnvidia-ml.so not found (no NVIDIA driver installed?)",
    13: "function not found in libnvidia-ml.so (driver older than nvidia-ml-py?)",
    15: "GPU is lost (fell off the bus?)",
    18: "NVML version mismatch between driver and library",
}


class GpuUnavailable(OomguardError):
    """NVML cannot tell us about the GPUs: `reason` says why, `code` is NVML's return code if any."""

    def __init__(self, reason: str, code: int | None = None) -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes > 0 else 0.0


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on one device. `used_bytes` is None where NVML cannot say (some drivers,
    MIG, no permission)."""

    pid: int  # host PID
    device_index: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuSnapshot:
    driver_version: str
    devices: tuple[GpuDevice, ...]
    processes: tuple[GpuProcess, ...]

    def vram_by_pid(self) -> dict[int, int]:
        """VRAM per PID summed over devices; an unknown amount counts as 0 (the PID is still listed)."""
        totals: dict[int, int] = {}
        for proc in self.processes:
            totals[proc.pid] = totals.get(proc.pid, 0) + (proc.used_bytes or 0)
        return totals

    def device(self, index: int) -> GpuDevice:
        """The device with NVML index `index`; KeyError if this snapshot has none."""
        for dev in self.devices:
            if dev.index == index:
                return dev
        raise KeyError(index)


def tree_vram(snapshot: GpuSnapshot, pids: Iterable[int]) -> int:
    """VRAM held by the given PIDs (a process tree), over all devices; unknown amounts count as 0."""
    by_pid = snapshot.vram_by_pid()
    return sum(by_pid.get(pid, 0) for pid in set(pids))


def _text(value: object) -> str:
    """pynvml < 11.5 returns bytes where newer releases return str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


NVML_LIBRARY = "libnvidia-ml.so.1"  # what pynvml loads on Linux
NVML_ERROR_LIBRARY_NOT_FOUND = 12


def _import_pynvml(library: str = NVML_LIBRARY) -> Any:
    """pynvml, once the driver's library is known to load: on a machine without NVIDIA's
    driver the daemon never imports it (pynvml and ctypes' types for it are ~3 MiB)."""
    import ctypes  # the library is looked for only here

    if "pynvml" not in sys.modules:  # (imported already: it answers for itself)
        if importlib.util.find_spec("pynvml") is None:
            raise ImportError("No module named 'pynvml'")
        try:
            ctypes.CDLL(library)
        except OSError as exc:  # what pynvml's nvmlInit would say
            raise _described("nvmlInit", "NVML Shared Library Not Found",
                             NVML_ERROR_LIBRARY_NOT_FOUND) from exc
    return importlib.import_module("pynvml")


class NvmlSensor:
    """Reads GPUs and their compute processes. Not thread-safe: one sensor per thread."""

    def __init__(self, loader: Callable[[], Any] | None = None) -> None:
        self._loader = loader or _import_pynvml
        self._nvml: Any = None
        self._initialised = False

    def available(self) -> tuple[bool, str]:
        """(True, driver version) or (False, why not). Never raises."""
        try:
            nvml = self._ensure_init()
            return True, f"NVIDIA driver {_text(self._call(nvml, 'nvmlSystemGetDriverVersion'))}"
        except GpuUnavailable as exc:
            return False, exc.reason
        except Exception as exc:  # a startup self-check: any surprise from the library is a "no"
            return False, f"NVML failed: {exc!r}"

    def snapshot(self) -> GpuSnapshot:
        """Every device and its compute processes. Raises GpuUnavailable."""
        nvml = self._ensure_init()
        driver = _text(self._call(nvml, "nvmlSystemGetDriverVersion"))
        devices: list[GpuDevice] = []
        processes: list[GpuProcess] = []
        for index in range(int(self._call(nvml, "nvmlDeviceGetCount"))):
            handle = self._call(nvml, "nvmlDeviceGetHandleByIndex", index)
            memory = self._call(nvml, "nvmlDeviceGetMemoryInfo", handle)
            devices.append(GpuDevice(
                index=index,
                uuid=_text(self._call(nvml, "nvmlDeviceGetUUID", handle)),
                name=_text(self._call(nvml, "nvmlDeviceGetName", handle)),
                total_bytes=int(memory.total),
                used_bytes=int(memory.used),
            ))
            processes += self._processes(nvml, index, handle)
        return GpuSnapshot(driver, tuple(devices), tuple(processes))

    def close(self) -> None:
        """nvmlShutdown if NVML was initialised; a failing shutdown is ignored (nothing to do about it)."""
        if not self._initialised:
            return
        self._initialised = False
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()

    def _processes(self, nvml: Any, index: int, handle: Any) -> list[GpuProcess]:
        try:
            infos = self._call(nvml, "nvmlDeviceGetComputeRunningProcesses", handle)
        except GpuUnavailable as exc:
            if exc.code == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED):
                return []  # this device cannot list processes: it just has none listed
            raise
        result = []
        for info in infos:
            used = getattr(info, "usedGpuMemory", None)
            result.append(GpuProcess(int(info.pid), index, None if used is None else int(used)))
        return result

    def _ensure_init(self) -> Any:
        if self._nvml is None:
            try:
                self._nvml = self._loader()
            except GpuUnavailable:
                raise
            except ImportError as exc:
                raise GpuUnavailable(f"nvidia-ml-py (pynvml) is not installed: {exc}") from exc
            except Exception as exc:  # a broken install raises anything at import
                raise GpuUnavailable(f"pynvml failed to load: {exc!r}") from exc
        if not self._initialised:
            self._call(self._nvml, "nvmlInit")
            self._initialised = True
        return self._nvml

    @staticmethod
    def _call(nvml: Any, name: str, *args: Any) -> Any:
        """`nvml.<name>(*args)` with NVMLError (and a missing function) turned into GpuUnavailable."""
        error_type = getattr(nvml, "NVMLError", None)
        try:
            function = getattr(nvml, name)
        except AttributeError as exc:
            raise GpuUnavailable(f"{name}: not in this pynvml (too old?)") from exc
        try:
            return function(*args)
        except Exception as exc:
            if error_type is None or not isinstance(exc, error_type):
                raise
            raise _unavailable(name, exc) from exc


def _unavailable(name: str, exc: Exception) -> GpuUnavailable:
    code = getattr(exc, "value", None)
    code = code if isinstance(code, int) else None
    try:
        text = str(exc)  # pynvml's __str__ calls into the library, which may be what is missing
    except Exception:
        text = ""
    return _described(name, text, code, type(exc).__name__)


def _described(name: str, text: str, code: int | None, fallback: str = "") -> GpuUnavailable:
    """`name: text; hint (NVML error code)`, the hint saying what the code usually means."""
    hint = _HINTS.get(code) if code is not None else None
    parts = [p for p in (text, hint) if p]
    detail = "; ".join(dict.fromkeys(parts)) or fallback
    suffix = f" (NVML error {code})" if code is not None else ""
    return GpuUnavailable(f"{name}: {detail}{suffix}", code)
