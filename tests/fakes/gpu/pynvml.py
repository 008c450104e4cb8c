"""A file-backed stand-in for `pynvml` (nvidia-ml-py), for real processes under test: put this
directory first on PYTHONPATH and point $OOMGUARD_FAKE_NVML at a JSON file

    {"driver": "580.1-fake", "devices": [{"name": "Fake GPU", "total": 8589934592,
     "base_used": 0}], "processes": [{"pid": 1234, "device": 0, "used": 1073741824}]}

read afresh on every call, so a test can change what the "GPU" holds while the daemon runs.
A process the fake cuda-checkpoint (same directory) has checkpointed holds no GPU memory, and
one that has exited none either, as with the real driver. Not a GPU: it stands in for NVML
only where this machine has none, beside the real CRIU and real processes."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(value)

    def __str__(self) -> str:
        return {12: "NVML Shared Library Not Found"}.get(self.value, f"NVML error {self.value}")


def _config() -> dict[str, Any]:
    path = os.environ.get("OOMGUARD_FAKE_NVML")
    if not path or not os.path.exists(path):
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as handle:
        data: dict[str, Any] = json.load(handle)
    return data


def _state(pid: int) -> str:
    directory = os.environ.get("FAKE_CUDA_STATE", "")
    try:
        with open(os.path.join(directory, str(pid))) as handle:
            return handle.read().strip()
    except OSError:
        return "running"


def _live(process: dict[str, Any]) -> bool:
    return os.path.exists(f"/proc/{process['pid']}") and _state(process["pid"]) != "checkpointed"


def nvmlInit() -> None:
    _config()


def nvmlShutdown() -> None:
    return None


def nvmlSystemGetDriverVersion() -> str:
    return str(_config().get("driver", "580.1-fake"))


def nvmlDeviceGetCount() -> int:
    return len(_config()["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetUUID(handle: int) -> str:
    return f"GPU-fake-{handle:04d}"


def nvmlDeviceGetName(handle: int) -> bytes:
    return str(_config()["devices"][handle]["name"]).encode()  # old pynvml returns bytes


def _processes(handle: int) -> list[dict[str, Any]]:
    return [p for p in _config().get("processes", []) if p["device"] == handle and _live(p)]


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    device = _config()["devices"][handle]
    used = int(device.get("base_used", 0)) + sum(int(p["used"]) for p in _processes(handle))
    return SimpleNamespace(total=int(device["total"]), used=used, free=int(device["total"]) - used)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used"]) for p in _processes(handle)]
