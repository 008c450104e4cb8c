"""What a checkpoint refused on the way to its stop leaves behind: nothing. A real process,
the real /proc, the daemon's own Checkpointer; the GPU is the one part faked (no NVML here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from oomguard.act.criu import Criu
from oomguard.act.freezer import SigstopFreezer
from oomguard.act.oomshield import OomShield
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.gpu.runtime import ENGINE_NONE, GpuSupport
from oomguard.lifecycle.checkpoint import Checkpointer, tree_of
from oomguard.model.errors import CheckpointFailed
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
