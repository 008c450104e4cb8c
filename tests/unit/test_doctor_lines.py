"""`oomguard doctor`'s GPU lines: one quiet line where no NVIDIA driver is loaded, the full
story (with warnings and hints) where one is; its process-events line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from oomguard.cli.doctor import (
    gpu_checks,
    kdat_check,
    kdat_dir,
    nvidia_driver_loaded,
    process_events_check,
)
from oomguard.gpu.nvml import NvmlSensor
from oomguard.gpu.runtime import detect_gpu
from oomguard.sense.procevents import EventBatch, EventSource
from tests.unit.fake_pynvml import FakeDevice, FakePynvml, NVMLError_LibraryNotFound

GiB = 1 << 30


def _sensor(missing: bool) -> NvmlSensor:
    fake = FakePynvml([FakeDevice("u0", "GPU", 8 * GiB, 0)],
                      init_error=NVMLError_LibraryNotFound() if missing else None)
    return NvmlSensor(loader=lambda: fake)


def _tool(tmp_path: Path) -> Path:
    path = tmp_path / "cuda-checkpoint"
    path.write_text("#!/bin/sh\necho 'Usage: cuda-checkpoint --action <lock|checkpoint>'\n")
    path.chmod(0o755)
    return path


def test_no_driver_is_one_passing_line(tmp_path: Path) -> None:
    gpu = detect_gpu(cuda_checkpoint=str(tmp_path / "absent"), sensor=_sensor(missing=True),
                     plugin_dirs=[str(tmp_path)])
    (line,) = gpu_checks(gpu, driver_loaded=False)
    assert (line.name, line.ok) == ("gpu", True)
    assert line.line() == "PASS  gpu: none (no NVIDIA driver loaded)"


def test_no_driver_names_a_cuda_checkpoint_that_waits_for_one(tmp_path: Path) -> None:
    tool = _tool(tmp_path)
    gpu = detect_gpu(cuda_checkpoint=str(tool), sensor=_sensor(missing=True),
                     plugin_dirs=[str(tmp_path)])
    (line,) = gpu_checks(gpu, driver_loaded=False)
    assert line.ok and str(tool) in line.detail


def test_a_driver_without_nvml_warns_line_by_line_with_hints(tmp_path: Path) -> None:
    gpu = detect_gpu(cuda_checkpoint=str(tmp_path / "absent"), sensor=_sensor(missing=True),
                     plugin_dirs=[str(tmp_path)])
    lines = gpu_checks(gpu, driver_loaded=True)
    assert [c.name for c in lines] == ["nvml", "cuda-checkpoint", "criu cuda plugin",
                                       "gpu actions"]
    assert all(not c.ok and c.warn_only for c in lines)
    assert "nvidia-ml-py" in lines[0].line()


def test_a_working_gpu_reports_its_engine(tmp_path: Path) -> None:
    gpu = detect_gpu(cuda_checkpoint=str(_tool(tmp_path)), sensor=_sensor(missing=False),
                     plugin_dirs=[str(tmp_path)])
    lines = gpu_checks(gpu, driver_loaded=False)  # NVML answering outranks the marks
    by_name = {c.name: c for c in lines}
    assert by_name["nvml"].ok and by_name["cuda-checkpoint"].ok and by_name["gpu actions"].ok


def test_driver_marks(tmp_path: Path) -> None:
    assert not nvidia_driver_loaded((str(tmp_path / "nvidia"),))
    (tmp_path / "nvidia").mkdir()
    assert nvidia_driver_loaded((str(tmp_path / "nvidia"),))


# -- process events --------------------------------------------------------------------------

class _Events:
    closed = False

    def fileno(self) -> int:
        return -1

    def read(self) -> EventBatch:
        return EventBatch()

    def close(self) -> None:
        self.closed = True


def test_process_events_from_the_connector() -> None:
    events = _Events()
    check = process_events_check(lambda: events)
    assert check.line() == "PASS  process events: kernel connector (fork/exit seen at once)"
    assert events.closed  # the probe's subscription is not kept


@pytest.mark.parametrize(("code", "why"), [
    (errno.EPERM, "EPERM: no CAP_NET_ADMIN"),
    (errno.ECONNREFUSED, "ECONNREFUSED: not in the initial network namespace (a container?)"),
])
def test_process_events_unavailable_say_why_and_what_instead(code: int, why: str) -> None:
    def refused() -> EventSource:
        raise OSError(code, os.strerror(code))

    check = process_events_check(refused)
    assert (check.ok, check.warn_only) == (False, True)
    first, hint = check.line().splitlines()
    assert first == f"WARN  process events: unavailable ({why}): freeze re-lists /proc"
    assert "escape the freeze" in hint and "exit status is unknown" in hint


def test_where_criu_keeps_its_kernel_probe(tmp_path: Path) -> None:
    binary = tmp_path / "criu"
    binary.write_bytes(b"\x7fELF\0junk\0/dev/shm/criu.kdat\0/dev/shm/.criu.kdat\0more")
    assert kdat_dir(binary) == "/dev/shm"
    binary.write_bytes(b"\x7fELF\0nothing here\0")
    assert kdat_dir(binary) is None
    assert kdat_dir(tmp_path / "absent") is None
    kept = kdat_check("/run", "tmpfs")
    assert kept.ok and "/run/criu.kdat on tmpfs" in kept.line()
    lost = kdat_check("/run", "ext4")
    assert not lost.ok and lost.warn_only and "probes the kernel at every start" in lost.line()
    assert "/dev/shm" in lost.line()  # the hint
    assert not kdat_check(None, None).ok

