"""GPU processes without a GPU: real processes in real cgroups, the real CRIU, and in place of
the two things this machine cannot have, NVML (tests/fakes/gpu/pynvml.py, first on PYTHONPATH)
and NVIDIA's cuda-checkpoint (tests/fakes/gpu/cuda-checkpoint). Both keep their state in files,
so the daemon, the CLI and CRIU see one coherent "GPU". The same flows run on a real GPU with
scripts/gpu-check."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.criu import find_criu
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    oomguard_argv,
    parse_events,
    proc_state,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

FAKES = REPO / "tests" / "fakes" / "gpu"
GiB = 1024 * MiB

FAILING_CRIU = """#!/bin/sh
case "$1" in
  --version|check) exec {criu} "$@" ;;
  *) echo "Error (simulated): dump failed" >&2; exit 1 ;;
esac
"""


class FakeGpu:
    """One fake GPU: what NVML reports, and the calls cuda-checkpoint received."""

    def __init__(self, work: Path, total: int = 8 * GiB) -> None:
        self.work = work
        self.state = work / "cuda-state"
        self.state.mkdir()
        self.nvml = work / "nvml.json"
        self.calls_log = work / "cuda.log"
        self.total = total
        self.processes: list[dict[str, int]] = []
        self.write()

    def write(self) -> None:
        self.nvml.write_text(json.dumps({
            "driver": "580.1-fake",
            "devices": [{"name": "Fake GPU", "total": self.total, "base_used": 0}],
            "processes": self.processes}))

    def holds(self, pid: int, used: int) -> None:
        self.processes.append({"pid": pid, "device": 0, "used": used})
        self.write()

    def library_dir(self) -> Path:
        """oomguard imports pynvml only once the driver's libnvidia-ml.so.1 loads: here a
        name for a library this machine has (libc), which the fake pynvml never calls."""
        directory = self.work / "lib"
        if not directory.exists():
            directory.mkdir()
            libc = next(line.split()[-1] for line in Path("/proc/self/maps").read_text()
                        .splitlines() if "/libc.so" in line or "/libc-" in line)
            (directory / "libnvidia-ml.so.1").symlink_to(libc)
        return directory

    def env(self, fail: str | None = None) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(FAKES), "OOMGUARD_FAKE_NVML": str(self.nvml),
               "LD_LIBRARY_PATH": str(self.library_dir()),
               "FAKE_CUDA_STATE": str(self.state), "FAKE_CUDA_LOG": str(self.calls_log),
               "OOMGUARD_CUDA_CHECKPOINT": str(FAKES / "cuda-checkpoint")}
        if fail:
            env["FAKE_CUDA_FAIL"] = fail
        return env

    def calls(self) -> list[dict[str, Any]]:
        if not self.calls_log.exists():
            return []
        return [json.loads(line) for line in self.calls_log.read_text().splitlines()]

    def actions(self) -> list[tuple[str, int]]:
        return [(c["action"], c["pid"]) for c in self.calls()]

    def cuda_state(self, pid: int) -> str:
        path = self.state / str(pid)
        return path.read_text() if path.exists() else "running"


def oomguard(store: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(oomguard_argv(store, *args), capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)


def refused(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The checkpoint.failed event of a CLI checkpoint that failed (exit 1)."""
    assert result.returncode == 1, result.stderr
    return next(e for e in parse_events(result.stderr) if e["event"] == "checkpoint.failed")


def counting(log: Path, timeout: float = 10) -> bool:
    mark = last_count(log)
    return bool(wait_until(lambda: last_count(log) > mark + 3, timeout))


def test_gpu_process_checkpoint_moves_cuda_state_first_and_restore_puts_it_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    gpu = FakeGpu(tmp_path)
    cg = cgroups.make("gpu", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=64, rate=200, count=100_000))
    assert wait_until(lambda: last_count(log) > 10, 10)
    gpu.holds(hog.pid, 512 * MiB)
    env = gpu.env()
    done = oomguard(store, env, "checkpoint", str(hog.pid))
    assert done.returncode == 0, done.stderr
    checkpoint_id = done.stdout.strip()
    hog.wait(timeout=10)
    # cuda-checkpoint ran first, on the running process (the real tool cannot act on a
    # stopped one), then CRIU dumped it.
    assert gpu.actions() == [("lock", hog.pid), ("checkpoint", hog.pid)]
    assert all(c["proc_state"] not in ("T", "t") for c in gpu.calls())
    meta = json.loads(oomguard(store, env, "show", checkpoint_id, "--json").stdout)
    assert (meta["gpu_pids"], meta["gpu_engine"], meta["vram_bytes"]) == \
        ([hog.pid], "cuda-checkpoint", 512 * MiB)
    mark = last_count(log)
    target = cgroups.make("gpubig", None)
    restored = oomguard(store, env, "restore", checkpoint_id, "--cgroup", str(target.path))
    assert restored.returncode == 0, restored.stderr
    pid = int(restored.stdout.strip())
    try:
        assert gpu.actions()[2:] == [("restore", pid), ("unlock", pid)]
        assert gpu.cuda_state(pid) == "running"
        assert wait_until(lambda: last_count(log) > mark + 5, 10)
        assert read_first_gap(log) is None
    finally:
        kill_pid(pid)


def read_first_gap(log: Path) -> int | None:
    counts = [int(line.split()[0]) for line in log.read_text().splitlines()
              if line and line[0].isdigit()]
    return next((b for a, b in itertools.pairwise(counts) if b != a + 1), None)


def test_cuda_checkpoint_failing_leaves_the_process_running_on_the_gpu(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    gpu = FakeGpu(tmp_path)
    cg = cgroups.make("gpufail", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=32, rate=200, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 10, 10)
        gpu.holds(hog.pid, 256 * MiB)
        failed = refused(oomguard(store, gpu.env(fail="checkpoint"), "checkpoint", str(hog.pid)))
        assert failed["outcome"] == "untouched"
        assert "CUDA state could not be moved off the GPU" in failed["error"]
        # Rolled back: the lock it took is released; CRIU never ran.
        assert gpu.actions() == [("lock", hog.pid), ("checkpoint", hog.pid),
                                 ("get-state", hog.pid), ("unlock", hog.pid)]
        assert gpu.cuda_state(hog.pid) == "running"
        assert proc_state(hog.pid) not in ("T", "t") and counting(log)
        assert not list(store.glob("2*"))
    finally:
        kill_pid(hog.pid)
        hog.wait(timeout=10)


def test_criu_failing_after_cuda_checkpoint_puts_the_state_back_on_the_gpu(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    gpu = FakeGpu(tmp_path)
    failing = tmp_path / "criu-fails"
    failing.write_text(FAILING_CRIU.format(criu=find_criu()[0]))
    failing.chmod(0o755)
    cg = cgroups.make("gpucriu", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=32, rate=200, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 10, 10)
        gpu.holds(hog.pid, 256 * MiB)
        env = {**gpu.env(), "OOMGUARD_CRIU": str(failing)}
        failed = refused(oomguard(store, env, "checkpoint", str(hog.pid)))
        assert failed["outcome"] == "thawed"
        assert "its CUDA state is back on the GPU" in failed["error"]
        assert gpu.actions() == [("lock", hog.pid), ("checkpoint", hog.pid),
                                 ("restore", hog.pid), ("unlock", hog.pid)]
        assert proc_state(hog.pid) not in ("T", "t") and counting(log)
    finally:
        kill_pid(hog.pid)
        hog.wait(timeout=10)


def test_not_enough_host_memory_for_the_vram_refuses_before_touching_it(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    gpu = FakeGpu(tmp_path, total=1 << 50)
    cg = cgroups.make("gpubudget", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=32, rate=200, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 10, 10)
        gpu.holds(hog.pid, 1 << 45)  # 32 TiB of VRAM: more than this machine's memory
        failed = refused(oomguard(store, gpu.env(), "checkpoint", str(hog.pid)))
        assert failed["outcome"] == "untouched" and "not enough host memory" in failed["error"]
        assert gpu.actions() == []
        assert counting(log)
    finally:
        kill_pid(hog.pid)
        hog.wait(timeout=10)


def test_gpu_pressure_rule_frees_vram_and_gpu_resume_brings_it_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A device at 93% of its memory (rule: 90%) with the `vram` action: cuda-checkpoint alone,
    the process keeps running in host memory; `oomguard gpu-resume` puts it back."""
    gpu = FakeGpu(tmp_path, total=1 * GiB)
    cg = cgroups.make("gpurule", 512 * MiB)
    config = tmp_path / "gpu.toml"
    config.write_text(f'[gpu]\npoll_interval = "200ms"\n\n[[guard]]\ncgroups = ["{cg.path}"]\n'
                      'gpu_threshold = "90%"\nactions = ["vram"]\n')
    log = tmp_path / "hog.log"
    env = gpu.env()
    with daemon(store, tmp_path / "daemon.log", "--config", str(config), env=env) as guard:
        started = guard.wait_event("guard.started")[0]
        assert started["gpu"] == "cuda-checkpoint", started
        hog = start_in_cgroup(cg, hog_argv(log, target=32, rate=200, count=100_000))
        try:
            assert wait_until(lambda: last_count(log) > 10, 10)
            gpu.holds(hog.pid, 950 * MiB)
            freed = guard.wait_event("gpu.vram_freed", timeout=20)[0]
            assert (freed["pid"], freed["gpu_pids"], freed["vram"]) == \
                (hog.pid, [hog.pid], 950 * MiB)
            crossed = [e for e in guard.events("threshold.crossed") if e.get("source") == "gpu"]
            assert crossed and "GPU 0 (Fake GPU)" in crossed[0]["reason"]
            # (a --get-state query after a step that timed out under load is the rollback
            # logic asking the tool where it got to: not an action)
            steps = [a for a in gpu.actions() if a[0] != "get-state"]
            assert steps == [("lock", hog.pid), ("checkpoint", hog.pid)]
            assert gpu.cuda_state(hog.pid) == "checkpointed"
            assert proc_state(hog.pid) not in ("T", "t") and counting(log)  # alive, on the CPU
            resumed = oomguard(store, env, "--socket", str(guard.socket), "gpu-resume",
                               str(hog.pid))
            assert resumed.returncode == 0, resumed.stderr
            after = [a for a in gpu.actions() if a[0] != "get-state"][2:]
            # The rule's 200 ms poll may already be acting again after the unlock.
            assert after[:2] == [("restore", hog.pid), ("unlock", hog.pid)], after
            # Running, unless that poll has locked it again already (read after the state).
            state = gpu.cuda_state(hog.pid)
            again = [a for a in gpu.actions() if a[0] != "get-state"][4:]
            assert state == "running" or again[:1] == [("lock", hog.pid)], (state, again)
            assert wait_until(lambda: guard.events("gpu.vram_restored"), 5)
            # Back on the GPU at 93%: the rule acts again, once its poll comes round.
            assert wait_until(lambda: len(guard.events("gpu.vram_freed")) == 2, 20)
        finally:
            kill_pid(hog.pid)
            hog.wait(timeout=10)
