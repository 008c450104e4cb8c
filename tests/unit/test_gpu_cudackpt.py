"""oomguard.gpu.cudackpt against a fake `cuda-checkpoint` executable run by the real SubprocessRunner.

The fake logs each call's arguments (one line a call) to calls.log, keeps per-PID CUDA state in
state.json, and is steered by files next to it: `fail` ("STEP PID" lines: that call exits 1),
`slow` ("STEP PID before|after": sleep 30 s before or after taking effect).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from oomguard.gpu import cudackpt
from oomguard.gpu.cudackpt import (
    CudaCheckpointer,
    CudaCheckpointError,
    CudaCheckpointTool,
    StepFailure,
    find_cuda_checkpoint,
    probe_tool,
    step_argv,
)
from oomguard.model.runner import CommandResult, SubprocessRunner
from tests.unit._support import make_executable

FAKE = r'''
import json, os, sys, time

MODE = "@MODE@"
HERE = os.path.dirname(os.path.abspath(__file__))
args = sys.argv[1:]
with open(os.path.join(HERE, "calls.log"), "a") as log:
    log.write(" ".join(args) + "\n")

def lines(name):
    try:
        with open(os.path.join(HERE, name)) as f:
            return [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []

if "--help" in args or "-h" in args:
    print("CUDA checkpoint and restore utility.")
    if MODE == "actions":
        print("    --get-state --pid <value>")
        print("    --action <value> --pid <value> [--timeout <value>]")
    print("    --toggle --pid <value>")
    print("    --help")
    sys.exit(0)

def opt(name):
    return args[args.index(name) + 1] if name in args else None

pid = opt("--pid")
path = os.path.join(HERE, "state.json")
states = json.load(open(path)) if os.path.exists(path) else {}
state = states.get(pid, "running")
if "--get-state" in args and MODE == "actions":
    print(state)
    sys.exit(0)
if "--toggle" in args:
    step = "toggle"
elif "--action" in args and MODE == "actions":
    step = opt("--action")
else:
    print("unknown option", file=sys.stderr)
    sys.exit(2)
if [step, pid] in lines("fail"):
    print(f"fake failure: {step} {pid}", file=sys.stderr)
    sys.exit(1)
moves = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
         "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}
if step == "toggle":
    new = {"running": "checkpointed", "checkpointed": "running"}.get(state)
else:
    before, after = moves[step]
    new = after if state == before else None
if new is None:
    print(f"cannot {step} pid {pid} in state {state}", file=sys.stderr)
    sys.exit(1)
if [step, pid, "before"] in lines("slow"):
    time.sleep(30)
states[pid] = new
with open(path + ".tmp", "w") as f:
    json.dump(states, f)
os.replace(path + ".tmp", path)
if [step, pid, "after"] in lines("slow"):
    time.sleep(30)
'''


@dataclass
class FakeTool:
    directory: Path

    @property
    def binary(self) -> str:
        return str(self.directory / "cuda-checkpoint")

    def write(self, mode: str = "actions") -> CudaCheckpointTool:
        make_executable(Path(self.binary), f"#!{sys.executable} -IS\n" + FAKE.replace("@MODE@", mode))
        return CudaCheckpointTool(self.binary, actions=mode == "actions")

    def fail(self, step: str, pid: int) -> None:
        with (self.directory / "fail").open("a") as f:
            f.write(f"{step} {pid}\n")

    def slow(self, step: str, pid: int, when: str) -> None:
        with (self.directory / "slow").open("a") as f:
            f.write(f"{step} {pid} {when}\n")

    def calls(self) -> list[str]:
        path = self.directory / "calls.log"
        return path.read_text().splitlines() if path.exists() else []

    def states(self) -> dict[str, str]:
        path = self.directory / "state.json"
        data: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        return data

    def set_state(self, pid: int, state: str) -> None:
        (self.directory / "state.json").write_text(json.dumps({**self.states(), str(pid): state}))

    def reset_log(self) -> None:
        (self.directory / "calls.log").unlink(missing_ok=True)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeTool]:
    yield FakeTool(tmp_path / "bin")


def checkpointer(tool: CudaCheckpointTool, timeout: float = 20.0, lock_ms: int = 500) -> CudaCheckpointer:
    return CudaCheckpointer(tool, SubprocessRunner(), lock_timeout_ms=lock_ms, timeout=timeout)


LOCK = "--action lock --pid {} --timeout 500"
CKPT = "--action checkpoint --pid {}"
RESTORE = "--action restore --pid {}"
UNLOCK = "--action unlock --pid {}"
STATE = "--get-state --pid {}"
TOGGLE = "--toggle --pid {}"

# -- discovery ------------------------------------------------------------------------------------


def test_probe_detects_both_interfaces(fake: FakeTool) -> None:
    fake.write("actions")
    assert probe_tool(fake.binary, SubprocessRunner()) == CudaCheckpointTool(fake.binary, actions=True)
    fake.write("legacy")
    assert probe_tool(fake.binary, SubprocessRunner()) == CudaCheckpointTool(fake.binary, actions=False)
    assert fake.calls() == ["--help", "--help"]


def test_probe_rejects_what_does_not_run_or_is_not_cuda_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CudaCheckpointError, match="cannot run"):
        probe_tool(str(tmp_path / "missing"), SubprocessRunner())
    other = make_executable(tmp_path / "other", "#!/bin/sh\necho usage: other\nexit 1\n")
    with pytest.raises(CudaCheckpointError, match="neither --action nor --toggle"):
        probe_tool(str(other), SubprocessRunner())


def test_find_prefers_configured_then_env_then_places_then_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configured = make_executable(tmp_path / "configured" / "cuda-checkpoint")
    from_env = make_executable(tmp_path / "env" / "cuda-checkpoint")
    placed = make_executable(tmp_path / "usr-local" / "cuda-checkpoint")
    on_path = make_executable(tmp_path / "path" / "cuda-checkpoint")
    monkeypatch.setattr(cudackpt, "CUDA_CHECKPOINT_CANDIDATES", (str(tmp_path / "nowhere"), str(placed)))
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setenv("OOMGUARD_CUDA_CHECKPOINT", str(from_env))
    assert find_cuda_checkpoint(str(configured)) == str(configured)
    assert find_cuda_checkpoint(str(tmp_path / "configured-but-missing")) is None
    assert find_cuda_checkpoint() == str(from_env)
    assert find_cuda_checkpoint("auto") == str(from_env)
    monkeypatch.delenv("OOMGUARD_CUDA_CHECKPOINT")
    assert find_cuda_checkpoint() == str(placed)
    monkeypatch.setattr(cudackpt, "CUDA_CHECKPOINT_CANDIDATES", ())
    assert find_cuda_checkpoint() == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_cuda_checkpoint() is None


def test_step_argv() -> None:
    tool = CudaCheckpointTool("/x/cuda-checkpoint", actions=True)
    assert step_argv(tool, "lock", 7, 250) == ["/x/cuda-checkpoint", "--action", "lock", "--pid", "7",
                                               "--timeout", "250"]
    assert step_argv(tool, "lock", 7, 0) == ["/x/cuda-checkpoint", "--action", "lock", "--pid", "7"]
    assert step_argv(tool, "restore", 7, 250) == ["/x/cuda-checkpoint", "--action", "restore", "--pid", "7"]
    assert step_argv(tool, "toggle", 7) == ["/x/cuda-checkpoint", "--toggle", "--pid", "7"]


def test_lock_timeout_must_be_shorter_than_the_command_timeout() -> None:
    tool = CudaCheckpointTool("/x/cuda-checkpoint", actions=True)
    with pytest.raises(ValueError, match="lock timeout"):
        CudaCheckpointer(tool, lock_timeout_ms=10_000, timeout=10.0)


# -- state ----------------------------------------------------------------------------------------


def test_state(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    assert ckpt.state(101) == "running"
    fake.set_state(101, "checkpointed")
    assert ckpt.state(101) == "checkpointed"


def test_state_unsupported_by_legacy_tool(fake: FakeTool) -> None:
    with pytest.raises(CudaCheckpointError, match="exit status 2: 'unknown option'"):
        checkpointer(fake.write("legacy")).state(101)


# -- suspend / resume, --action interface ---------------------------------------------------------


def test_suspend_and_resume_one_pid(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    ckpt.suspend([101])
    assert fake.calls() == [LOCK.format(101), CKPT.format(101)]
    assert fake.states() == {"101": "checkpointed"}
    fake.reset_log()
    ckpt.resume([101])
    assert fake.calls() == [RESTORE.format(101), UNLOCK.format(101)]
    assert fake.states() == {"101": "running"}


def test_suspend_and_resume_two_pids(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    ckpt.suspend([101, 102, 101])  # a repeated PID is handled once
    assert fake.calls() == [LOCK.format(101), CKPT.format(101), LOCK.format(102), CKPT.format(102)]
    assert fake.states() == {"101": "checkpointed", "102": "checkpointed"}
    fake.reset_log()
    ckpt.resume([101, 102])
    assert fake.calls() == [RESTORE.format(101), UNLOCK.format(101), RESTORE.format(102), UNLOCK.format(102)]
    assert fake.states() == {"101": "running", "102": "running"}


def test_checkpoint_failure_on_second_pid_rolls_back_in_reverse(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    fake.fail("checkpoint", 102)
    with pytest.raises(CudaCheckpointError) as info:
        ckpt.suspend([101, 102])
    assert fake.calls() == [
        LOCK.format(101), CKPT.format(101), LOCK.format(102), CKPT.format(102),
        STATE.format(102),  # what did the failed step leave? (locked: it did not take effect)
        UNLOCK.format(102), RESTORE.format(101), UNLOCK.format(101),
    ]
    assert fake.states() == {"101": "running", "102": "running"}
    message = str(info.value)
    assert "checkpoint failed for pid 102" in message
    assert "fake failure: checkpoint 102" in message
    assert message.endswith("rolled back")
    assert info.value.failures == (
        StepFailure(102, "checkpoint", "exit status 1: 'fake failure: checkpoint 102'"),)


def test_lock_failure_on_first_pid_touches_nothing_else(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    fake.fail("lock", 101)
    with pytest.raises(CudaCheckpointError, match="lock failed for pid 101"):
        ckpt.suspend([101, 102])
    assert fake.calls() == [LOCK.format(101), STATE.format(101)]
    assert fake.states() == {}


def test_lock_failure_on_second_pid_restores_the_first(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    fake.fail("lock", 102)
    with pytest.raises(CudaCheckpointError, match="lock failed for pid 102"):
        ckpt.suspend([101, 102])
    assert fake.calls() == [LOCK.format(101), CKPT.format(101), LOCK.format(102), STATE.format(102),
                            RESTORE.format(101), UNLOCK.format(101)]
    assert fake.states() == {"101": "running"}


def test_failed_rollback_is_reported_and_the_rest_still_rolled_back(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    fake.fail("checkpoint", 102)
    fake.fail("unlock", 102)
    with pytest.raises(CudaCheckpointError) as info:
        ckpt.suspend([101, 102])
    assert fake.calls()[-5:] == [STATE.format(102), UNLOCK.format(102), STATE.format(102),
                                 RESTORE.format(101), UNLOCK.format(101)]
    assert fake.states() == {"101": "running", "102": "locked"}
    assert "ROLLBACK FAILED" in str(info.value)
    assert [(f.pid, f.step) for f in info.value.failures] == [(102, "checkpoint"), (102, "unlock")]


def test_timeout_counts_as_failure(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write(), timeout=0.5, lock_ms=100)
    fake.slow("checkpoint", 102, "before")
    with pytest.raises(CudaCheckpointError, match=r"checkpoint failed for pid 102: timed out after 0.5s"):
        ckpt.suspend([101, 102])
    lock = "--action lock --pid {} --timeout 100"
    assert fake.calls() == [lock.format(101), CKPT.format(101), lock.format(102), CKPT.format(102),
                            STATE.format(102), UNLOCK.format(102), RESTORE.format(101), UNLOCK.format(101)]
    assert fake.states() == {"101": "running", "102": "running"}


def test_timed_out_step_that_took_effect_is_undone_too(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write(), timeout=0.5, lock_ms=100)
    fake.slow("checkpoint", 101, "after")
    with pytest.raises(CudaCheckpointError, match="timed out"):
        ckpt.suspend([101])
    assert fake.calls()[-4:] == [CKPT.format(101), STATE.format(101), RESTORE.format(101), UNLOCK.format(101)]
    assert fake.states() == {"101": "running"}


def test_resume_carries_on_after_a_failure(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    ckpt.suspend([101, 102, 103])
    fake.reset_log()
    fake.fail("restore", 102)
    with pytest.raises(CudaCheckpointError) as info:
        ckpt.resume([101, 102, 103])
    assert fake.calls() == [RESTORE.format(101), UNLOCK.format(101), RESTORE.format(102), STATE.format(102),
                            RESTORE.format(103), UNLOCK.format(103)]
    assert fake.states() == {"101": "running", "102": "checkpointed", "103": "running"}
    assert "resume failed for 1 of 3 processes" in str(info.value)
    assert info.value.failures == (
        StepFailure(102, "restore", "exit status 1: 'fake failure: restore 102' (state: checkpointed)"),)


def test_resume_of_a_locked_or_running_process_succeeds(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    fake.set_state(101, "locked")  # suspend got as far as lock, then the daemon died
    ckpt.resume([101, 102])  # 102 was never suspended
    assert fake.calls() == [RESTORE.format(101), STATE.format(101), UNLOCK.format(101),
                            RESTORE.format(102), STATE.format(102)]
    assert fake.states() == {"101": "running"}


def test_tool_gone_is_a_failure_not_a_crash(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write())
    Path(fake.binary).unlink()
    with pytest.raises(CudaCheckpointError, match="lock failed for pid 101: cannot run"):
        ckpt.suspend([101])
    with pytest.raises(CudaCheckpointError, match="restore pid 101: cannot run"):
        ckpt.resume([101])


# -- legacy --toggle interface --------------------------------------------------------------------


def test_legacy_toggle_suspend_and_resume(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write("legacy"))
    ckpt.suspend([101, 102])
    assert fake.calls() == [TOGGLE.format(101), TOGGLE.format(102)]
    assert fake.states() == {"101": "checkpointed", "102": "checkpointed"}
    fake.reset_log()
    ckpt.resume([101, 102])
    assert fake.calls() == [TOGGLE.format(101), TOGGLE.format(102)]
    assert fake.states() == {"101": "running", "102": "running"}


def test_legacy_toggle_failure_toggles_back_in_reverse(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write("legacy"))
    fake.fail("toggle", 103)
    with pytest.raises(CudaCheckpointError, match="toggle failed for pid 103") as info:
        ckpt.suspend([101, 102, 103])
    assert fake.calls() == [TOGGLE.format(101), TOGGLE.format(102), TOGGLE.format(103),
                            TOGGLE.format(102), TOGGLE.format(101)]  # no --get-state: r550 lacks it
    assert fake.states() == {"101": "running", "102": "running"}
    assert [(f.pid, f.step) for f in info.value.failures] == [(103, "toggle")]


def test_legacy_resume_reports_every_failure(fake: FakeTool) -> None:
    ckpt = checkpointer(fake.write("legacy"))
    ckpt.suspend([101, 102])
    fake.fail("toggle", 101)
    fake.fail("toggle", 102)
    with pytest.raises(CudaCheckpointError, match="resume failed for 2 of 2 processes") as info:
        ckpt.resume([101, 102])
    assert [(f.pid, f.step) for f in info.value.failures] == [(101, "toggle"), (102, "toggle")]


class _GatedRunner:
    """Runs the fake tool, but holds a resume's `restore` step until released, to let another
    thread try to act on the same process in the middle of the resume."""

    def __init__(self) -> None:
        self.inner = SubprocessRunner()
        self.in_restore = threading.Event()
        self.release = threading.Event()

    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = ()) -> CommandResult:
        result = self.inner.run(argv, timeout=timeout, env=env, pass_fds=pass_fds)
        if "restore" in argv:
            self.in_restore.set()
            self.release.wait(10)
        return result


def test_a_suspend_waits_for_a_resume_in_flight_on_another_thread(fake: FakeTool) -> None:
    """The daemon's rule (its poll thread) suspending while a user's gpu-resume (a control
    connection) is between its restore and its unlock: the steps do not interleave (the CI run
    that saw restore, lock, unlock)."""
    tool = fake.write("actions")
    runner = _GatedRunner()
    ckpt = CudaCheckpointer(tool, runner, lock_timeout_ms=500, timeout=20.0)
    fake.set_state(41, "checkpointed")
    resumer = threading.Thread(target=ckpt.resume, args=([41],))
    resumer.start()
    assert runner.in_restore.wait(10)
    suspender = threading.Thread(target=ckpt.suspend, args=([41],))
    suspender.start()
    suspender.join(0.5)
    assert suspender.is_alive()  # waiting, not locking a process that is mid-resume
    runner.release.set()
    resumer.join(10)
    suspender.join(10)
    steps = [line.split()[1] for line in fake.calls() if line.startswith("--action")]
    assert steps == ["restore", "unlock", "lock", "checkpoint"]
    assert fake.states()["41"] == "checkpointed"
