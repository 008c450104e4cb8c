"""NVIDIA's cuda-checkpoint as an actuator: moves a process's CUDA state between the GPU and its
own host memory, so CRIU can then dump it like any other process.

Driver r555+ tools have `--get-state` (running | locked | checkpointed | failed) and
`--action lock|checkpoint|restore|unlock`; r550 only `--toggle` (running <-> checkpointed).
`suspend` and `resume` roll back or carry on so that a failure leaves processes running on the GPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.model.errors import OomguardError
from oomguard.model.runner import CommandRunner, SubprocessRunner, executable_candidates

CUDA_CHECKPOINT_CANDIDATES = ("/usr/local/bin/cuda-checkpoint", "/usr/bin/cuda-checkpoint")
STATES = ("running", "locked", "checkpointed", "failed")
PROBE_TIMEOUT = 10.0
# What brings a process back to running from where suspend left it.
_BACK = {"checkpointed": ("restore", "unlock"), "locked": ("unlock",), "toggled": ("toggle",)}
_REACHED = {"lock": "locked", "checkpoint": "checkpointed", "toggle": "toggled"}


@dataclass(frozen=True)
class StepFailure:
    pid: int
    step: str  # lock | checkpoint | restore | unlock | toggle
    detail: str  # timed out, or exit status and the tool's message

    def __str__(self) -> str:
        return f"{self.step} pid {self.pid}: {self.detail}"


class CudaCheckpointError(OomguardError):
    """cuda-checkpoint failed; `failures` lists every step that did, first the one that started it."""

    def __init__(self, message: str, failures: Sequence[StepFailure] = ()) -> None:
        self.failures = tuple(failures)
        super().__init__(message)


@dataclass(frozen=True)
class CudaCheckpointTool:
    binary: str
    actions: bool  # True: --action/--get-state (r555+); False: --toggle only


def find_cuda_checkpoint(configured: str | None = None) -> str | None:
    """The first executable cuda-checkpoint: the configured path (alone, if given), else
    $OOMGUARD_CUDA_CHECKPOINT, the usual install places, then $PATH. None if there is none."""
    for candidate in executable_candidates(configured, "OOMGUARD_CUDA_CHECKPOINT",
                                           CUDA_CHECKPOINT_CANDIDATES, "cuda-checkpoint"):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def probe_tool(binary: str, runner: CommandRunner | None = None) -> CudaCheckpointTool:
    """Which interface `binary --help` offers. Raises CudaCheckpointError if it does not run or
    does not look like cuda-checkpoint."""
    runner = runner or SubprocessRunner()
    try:
        result = runner.run([binary, "--help"], timeout=PROBE_TIMEOUT)
    except OSError as exc:
        raise CudaCheckpointError(f"cannot run {binary}: {exc}") from exc
    if result.timed_out:
        raise CudaCheckpointError(f"{binary} --help timed out after {PROBE_TIMEOUT:g}s")
    text = result.stdout + result.stderr
    if "--action" in text:
        return CudaCheckpointTool(binary, actions=True)
    if "--toggle" in text:
        return CudaCheckpointTool(binary, actions=False)
    raise CudaCheckpointError(f"{binary} --help (exit status {result.returncode}) offers neither "
                              f"--action nor --toggle: {_tail(text)!r}")


def step_argv(tool: CudaCheckpointTool, step: str, pid: int, lock_timeout_ms: int = 0) -> list[str]:
    if step == "toggle":
        return [tool.binary, "--toggle", "--pid", str(pid)]
    argv = [tool.binary, "--action", step, "--pid", str(pid)]
    if step == "lock" and lock_timeout_ms > 0:
        argv += ["--timeout", str(lock_timeout_ms)]
    return argv


def _tail(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


class CudaCheckpointer:
    """Suspends (GPU -> host memory) and resumes CUDA processes. `timeout` bounds every command
    (a timed-out command has failed); `lock_timeout_ms` is the tool's own wait for in-flight CUDA
    calls to finish, so it must be shorter."""

    def __init__(self, tool: CudaCheckpointTool, runner: CommandRunner | None = None,
                 lock_timeout_ms: int = 10_000, timeout: float = 120.0) -> None:
        if lock_timeout_ms >= timeout * 1000:
            raise ValueError(f"lock timeout {lock_timeout_ms}ms must be shorter than the command "
                             f"timeout {timeout:g}s")
        self.tool = tool
        self.runner: CommandRunner = runner or SubprocessRunner()
        self.lock_timeout_ms = lock_timeout_ms
        self.timeout = timeout
        # One suspend or resume at a time: the daemon's rule (its poll thread) and a user's
        # gpu-resume (a control connection) must not interleave steps on the same process
        # (a lock between a resume's restore and its unlock).
        self._busy = threading.Lock()

    def state(self, pid: int) -> str:
        """running | locked | checkpointed | failed. Raises CudaCheckpointError."""
        argv = [self.tool.binary, "--get-state", "--pid", str(pid)]
        try:
            result = self.runner.run(argv, timeout=self.timeout)
        except OSError as exc:
            raise CudaCheckpointError(f"cannot run {self.tool.binary}: {exc}") from exc
        state = result.stdout.strip().lower()
        if result.timed_out or result.returncode != 0 or state not in STATES:
            detail = f"timed out after {self.timeout:g}s" if result.timed_out else (
                f"exit status {result.returncode}: {_tail(result.stderr or result.stdout)!r}")
            raise CudaCheckpointError(f"cuda-checkpoint --get-state pid {pid}: {detail}")
        return state

    def suspend(self, pids: Sequence[int]) -> None:
        """Lock and checkpoint (or toggle) each process, in order. On any failure, every process
        touched is brought back to running, last first, and CudaCheckpointError is raised."""
        with self._busy:
            self._suspend(pids)

    def _suspend(self, pids: Sequence[int]) -> None:
        steps = ("lock", "checkpoint") if self.tool.actions else ("toggle",)
        reached: dict[int, str] = {}  # pid -> locked | checkpointed | toggled, in suspend order
        for pid in dict.fromkeys(pids):
            for step in steps:
                detail = self._run(step, pid)
                if detail is None:
                    reached[pid] = _REACHED[step]
                    continue
                failure = StepFailure(pid, step, detail)
                if self.tool.actions and self._state_or_none(pid) == _REACHED[step]:
                    reached[pid] = _REACHED[step]  # it failed (timed out) after all took effect
                undo = [f for p in reversed(reached) if (f := self._back_to_running(p, reached[p]))]
                outcome = ("rolled back" if not undo else
                           "ROLLBACK FAILED, left suspended: " + "; ".join(str(f) for f in undo))
                raise CudaCheckpointError(
                    f"cuda-checkpoint {step} failed for pid {pid}: {detail}; {outcome}",
                    [failure, *undo])

    def resume(self, pids: Sequence[int]) -> None:
        """Restore and unlock (or toggle back) each process; a failure does not stop the others.
        Raises CudaCheckpointError listing every process that failed."""
        start = "checkpointed" if self.tool.actions else "toggled"
        wanted = list(dict.fromkeys(pids))
        with self._busy:
            failures = [f for pid in wanted if (f := self._back_to_running(pid, start))]
        if failures:
            raise CudaCheckpointError(
                f"cuda-checkpoint resume failed for {len(failures)} of {len(wanted)} processes: "
                + "; ".join(str(f) for f in failures), failures)

    def _back_to_running(self, pid: int, reached: str) -> StepFailure | None:
        """Undo suspend's steps on one process. After a failed step the tool's own state, when it
        can tell, decides: running is done, locked after a failed restore still gets its unlock."""
        for step in _BACK[reached]:
            detail = self._run(step, pid)
            if detail is None:
                continue
            state = self._state_or_none(pid) if self.tool.actions else None
            if state == "running":
                return None
            if not (step == "restore" and state == "locked"):
                return StepFailure(pid, step, detail if state is None else f"{detail} (state: {state})")
        return None

    def _run(self, step: str, pid: int) -> str | None:
        """Run one step; None if it succeeded, else why not."""
        argv = step_argv(self.tool, step, pid, self.lock_timeout_ms)
        try:
            result = self.runner.run(argv, timeout=self.timeout)
        except OSError as exc:
            return f"cannot run {self.tool.binary}: {exc}"
        if result.timed_out:
            return f"timed out after {self.timeout:g}s"
        if result.returncode != 0:
            return f"exit status {result.returncode}: {_tail(result.stderr or result.stdout)!r}"
        return None

    def _state_or_none(self, pid: int) -> str | None:
        try:
            return self.state(pid)
        except CudaCheckpointError:
            return None
