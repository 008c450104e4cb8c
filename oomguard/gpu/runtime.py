"""GPU support as the daemon, the checkpointer and the restorer use it: which engine moves CUDA
state out of the GPU (oomguard driving NVIDIA's cuda-checkpoint, or CRIU's own CUDA plugin), the
NVML sensor for VRAM accounting, and the host-memory budget a GPU checkpoint needs.

Detection never raises: without the NVML library, the driver, a GPU or a cuda-checkpoint, GPU
support is off (or accounting-only) and `why` says which; nothing else changes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.gpu.cudackpt import (
    CudaCheckpointer,
    CudaCheckpointError,
    CudaCheckpointTool,
    find_cuda_checkpoint,
    probe_tool,
)
from oomguard.gpu.nvml import GpuSnapshot, GpuUnavailable, NvmlSensor
from oomguard.model.runner import CommandRunner, SubprocessRunner

ENGINE_CUDA_CHECKPOINT = "cuda-checkpoint"
ENGINE_CRIU_PLUGIN = "criu-plugin"
ENGINE_NONE = "none"  # no way to checkpoint CUDA state: GPU processes are refused, not dumped
CRIU_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu")
CUDA_PLUGIN = "cuda_plugin.so"


def find_criu_cuda_plugin(dirs: Iterable[str] | None = None) -> Path | None:
    """CRIU's CUDA plugin where CRIU loads plugins from ($CRIU_LIBS_DIR, else its default)."""
    env = os.environ.get("CRIU_LIBS_DIR")
    for directory in ([env] if env else []) + list(dirs or CRIU_PLUGIN_DIRS):
        path = Path(directory) / CUDA_PLUGIN
        if path.is_file():
            return path
    return None


@dataclass
class GpuSupport:
    """What this machine can do for GPU processes. `accounting`: NVML works (VRAM counts in
    victim choice, GPU pressure can trigger rules); `engine`: what checkpoints CUDA state."""

    accounting: bool
    engine: str
    why: str
    sensor: NvmlSensor | None = None
    tool: CudaCheckpointTool | None = None
    plugin: Path | None = None
    checkpointer: CudaCheckpointer | None = None
    driver: str = ""
    _last: GpuSnapshot | None = field(default=None, repr=False)
    # The daemon's loop and its action threads read NVML; the sensor is not thread-safe.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def off(cls, why: str) -> GpuSupport:
        return cls(accounting=False, engine=ENGINE_NONE, why=why)

    def snapshot(self) -> GpuSnapshot | None:
        if not self.accounting or self.sensor is None:
            return None
        with self._lock:
            try:
                self._last = self.sensor.snapshot()
            except GpuUnavailable:
                return None
            return self._last

    def vram_by_pid(self) -> dict[int, int]:
        snap = self.snapshot()
        return snap.vram_by_pid() if snap is not None else {}

    def gpu_pids(self, pids: Iterable[int], vram: dict[int, int] | None = None) -> list[int]:
        """The pids (of a tree) that hold a CUDA context, in the given order."""
        vram = self.vram_by_pid() if vram is None else vram
        return [pid for pid in pids if pid in vram]

    @property
    def drives_cuda(self) -> bool:
        """oomguard itself moves CUDA state with cuda-checkpoint (with rollback)."""
        return self.engine == ENGINE_CUDA_CHECKPOINT and self.checkpointer is not None

    def suspend(self, pids: Sequence[int]) -> None:
        """CUDA state of `pids` into host memory, the GPU freed (rolled back on failure)."""
        if self.checkpointer is None:
            raise CudaCheckpointError("no cuda-checkpoint: CUDA state cannot be moved off the GPU")
        self.checkpointer.suspend(pids)

    def resume(self, pids: Sequence[int]) -> None:
        if self.checkpointer is None:
            raise CudaCheckpointError("no cuda-checkpoint: CUDA state cannot be brought back")
        self.checkpointer.resume(pids)

    def lines(self) -> list[tuple[bool, str]]:
        """For `oomguard doctor`: (fine, text) per line."""
        found = [(self.accounting, f"NVML: {self.why if not self.accounting else self.driver}")]
        if self.tool is not None:
            mode = "--action lock/checkpoint/restore/unlock" if self.tool.actions else "--toggle"
            found.append((True, f"cuda-checkpoint: {self.tool.binary} ({mode})"))
        else:
            found.append((False, "cuda-checkpoint: not found (config gpu.cuda_checkpoint, "
                                 "$OOMGUARD_CUDA_CHECKPOINT, /usr/local/bin, /usr/bin, PATH)"))
        found.append((self.plugin is not None,
                      f"CRIU CUDA plugin: {self.plugin or 'not installed'}"))
        actions = {ENGINE_CUDA_CHECKPOINT: "checkpoint (cuda-checkpoint, then CRIU), vram "
                                           "(cuda-checkpoint alone)",
                   ENGINE_CRIU_PLUGIN: "checkpoint (CRIU's CUDA plugin)",
                   ENGINE_NONE: "none: GPU processes are refused (not dumped) and fall back"}
        if not self.accounting:
            found.append((False, "GPU actions: none: without NVML no process is known to hold "
                                 "GPU memory (they are dumped like any other, which fails for "
                                 "a live CUDA context)"))
        else:
            found.append((self.engine != ENGINE_NONE, f"GPU actions: {actions[self.engine]}"))
        return found


def detect_gpu(engine: str = "auto", cuda_checkpoint: str = "auto", *,
               lock_timeout: float = 10.0, timeout: float = 300.0,
               runner: CommandRunner | None = None, sensor: NvmlSensor | None = None,
               plugin_dirs: Iterable[str] | None = None) -> GpuSupport:
    """The GPU support this machine offers under the [gpu] settings."""
    if engine == "off":
        return GpuSupport.off("off in the config ([gpu] engine = \"off\")")
    sensor = sensor or NvmlSensor()
    runner = runner or SubprocessRunner()
    tool: CudaCheckpointTool | None = None
    binary = find_cuda_checkpoint(cuda_checkpoint)
    note = ""
    if binary is not None:
        try:
            tool = probe_tool(binary, runner)
        except CudaCheckpointError as exc:
            note = f"; cuda-checkpoint unusable: {exc}"
    plugin = find_criu_cuda_plugin(plugin_dirs)
    ok, reason = sensor.available()
    if not ok:
        return GpuSupport(accounting=False, engine=ENGINE_NONE, why=reason, sensor=sensor,
                          tool=tool, plugin=plugin)
    chosen = ENGINE_NONE
    if engine in ("auto", ENGINE_CUDA_CHECKPOINT) and tool is not None:
        chosen = ENGINE_CUDA_CHECKPOINT
    elif engine in ("auto", ENGINE_CRIU_PLUGIN) and plugin is not None:
        chosen = ENGINE_CRIU_PLUGIN
    checkpointer = CudaCheckpointer(tool, runner, lock_timeout_ms=int(lock_timeout * 1000),
                                    timeout=timeout) if tool is not None else None
    driver = reason
    why = reason + note if chosen != ENGINE_NONE else (
        f"{reason}; no {engine if engine != 'auto' else 'cuda-checkpoint or CRIU CUDA plugin'} "
        f"found{note}: GPU processes are refused, not dumped")
    return GpuSupport(accounting=True, engine=chosen, why=why, sensor=sensor, tool=tool,
                      plugin=plugin, checkpointer=checkpointer, driver=driver)
