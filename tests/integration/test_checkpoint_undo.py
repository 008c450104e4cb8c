"""What a checkpoint refused on the way to its stop leaves behind: nothing. A real process,
the real /proc, the daemon's own Checkpointer; the GPU is the one part faked (no NVML here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from oomguard.act.criu import Criu
from oomguard.act.freezer import SigstopFreezer
from oomguard.act.frozen import Frozen
from oomguard.act.oomshield import OomShield
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.gpu.runtime import ENGINE_CUDA_CHECKPOINT, ENGINE_NONE, GpuSupport
from oomguard.lifecycle.checkpoint import Checkpointer, tree_of
from oomguard.model.errors import CheckpointFailed, TreeNotYours
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from tests.helpers import kill_pid, proc_state, wait_until

pytestmark = pytest.mark.integration
GiB = 1 << 30


class RecordingShield(OomShield):
    """The real shield, and what it was asked: root here lacks CAP_SYS_RESOURCE, so the
    kernel refuses the -1000 itself (the v2 lane's root writes it)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.shielded: set[int] = set()
        self.unshielded: set[int] = set()

    def shield(self, pids: list[int], inherited: int | None = None) -> list[int]:
        self.shielded.update(pids)
        return super().shield(pids, inherited)

    def unshield(self, pids: list[int] | None = None) -> None:
        self.unshielded.update(pids or ())
        super().unshield(pids)


def test_a_gpu_tree_refused_before_its_stop_is_left_as_it_was(tmp_path: Path) -> None:
    """On cgroup v2 the tree is shielded from the OOM killer (oom_score_adj -1000) until it
    has stopped; a GPU hand-off refused before the stop (no engine for its CUDA state) must
    put the shield back, or the job is never an OOM victim again (it kept -1000 before)."""
    # Not this process's child (oomguard never takes its own family): started by a shell
    # that exits at once, in a session of its own.
    pid = int(subprocess.run(["setsid", "sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & "
                              "echo $!"], capture_output=True, text=True, check=True).stdout)
    try:
        adj = Path(f"/proc/{pid}/oom_score_adj")
        adj.write_text("300")
        gpu = GpuSupport(accounting=True, engine=ENGINE_NONE, why="no cuda-checkpoint found")
        gpu.vram_by_pid = lambda: {pid: GiB}  # type: ignore[method-assign]
        mount = tmp_path / "unified"
        (mount / "job").mkdir(parents=True)
        cgroup = V2MemoryCgroup(mount / "job", mount)  # v2: the shield is needed
        shield = RecordingShield(tmp_path / "shield.json")
        checkpointer = Checkpointer(Criu(binary="/nonexistent/criu", version=(4, 2)),
                                    Store(tmp_path / "store"), SigstopFreezer(), gpu=gpu,
                                    shield=shield)
        with pytest.raises(CheckpointFailed, match="refused before stopping it"):
            checkpointer.checkpoint(tree_of(pid, ProcReader()), cgroup, "test", headroom=0)
        assert shield.shielded == {pid} and shield.unshielded >= shield.shielded
        assert adj.read_text().strip() == "300"
        assert ProcReader().state(pid) in "SR"  # never stopped
        assert checkpointer.ledger.recorded([pid]) == []  # no crash record left
    finally:
        kill_pid(pid)
        wait_until(lambda: proc_state(pid) in (None, "Z"), 5.0)


class RecordingCuda:
    """cuda-checkpoint as the daemon calls it (no GPU here): what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def suspend(self, pids: list[int]) -> None:
        self.calls.append(("suspend", tuple(pids)))

    def resume(self, pids: list[int]) -> None:
        self.calls.append(("resume", tuple(pids)))


def started_alone() -> int:
    """A process not of this one's family (oomguard never takes its own), in a session of
    its own, counting nothing: a sleep."""
    return int(subprocess.run(["setsid", "sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & "
                               "echo $!"], capture_output=True, text=True, check=True).stdout)


def test_a_gpu_tree_refused_once_stopped_runs_on_with_its_cuda_state_back_on_the_gpu(
        tmp_path: Path) -> None:
    """Refused once stopped (a task not the asking user's: here, root's tree asked for by
    uid 65534): the unwinding thaws it and puts its CUDA state back on the GPU, as after a
    failed dump (a thawed process whose CUDA state stays in host memory blocks on its next
    CUDA call), and leaves no crash record."""
    pid = started_alone()
    try:
        cuda = RecordingCuda()
        gpu = GpuSupport(accounting=True, engine=ENGINE_CUDA_CHECKPOINT, why="fake",
                         checkpointer=cuda)  # type: ignore[arg-type]
        gpu.vram_by_pid = lambda: {pid: 64 << 20}  # type: ignore[method-assign]
        checkpointer = Checkpointer(Criu(binary="/nonexistent/criu", version=(4, 2)),
                                    Store(tmp_path / "store"), SigstopFreezer(), gpu=gpu)
        with pytest.raises(TreeNotYours, match="refused, nothing dumped"):
            checkpointer.checkpoint(tree_of(pid, ProcReader()), None, "test", headroom=0,
                                    rights_of=65534)
        assert cuda.calls == [("suspend", (pid,)), ("resume", (pid,))]
        assert wait_until(lambda: proc_state(pid) in ("S", "R"), 5.0)  # thawed
        assert checkpointer.ledger.recorded([pid]) == []
    finally:
        kill_pid(pid)
        wait_until(lambda: proc_state(pid) in (None, "Z"), 5.0)


def test_an_unforeseen_error_once_stopped_still_thaws_the_tree(tmp_path: Path) -> None:
    """Whatever ends a checkpoint once its tree has stopped (here: the caller's on_frozen
    raising, a bug's way out), the tree is continued and the crash ledger cleared; the
    error goes on as it is."""
    pid = started_alone()
    try:
        checkpointer = Checkpointer(Criu(binary="/nonexistent/criu", version=(4, 2)),
                                    Store(tmp_path / "store"), SigstopFreezer())
        seen: list[int] = []

        def on_frozen(frozen: Frozen, at: float) -> None:
            seen.extend(frozen.pids)
            assert proc_state(pid) == "T"
            raise RuntimeError("a bug in the caller")

        with pytest.raises(RuntimeError, match="a bug in the caller"):
            checkpointer.checkpoint(tree_of(pid, ProcReader()), None, "test", on_frozen,
                                    headroom=0)
        assert seen == [pid]
        assert wait_until(lambda: proc_state(pid) in ("S", "R"), 5.0)
        assert checkpointer.ledger.recorded([pid]) == []
    finally:
        kill_pid(pid)
        wait_until(lambda: proc_state(pid) in (None, "Z"), 5.0)
