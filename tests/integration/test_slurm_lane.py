"""Slurm end to end in the cgroup v2 VM lane (tests/vmlane_slurm.sh): a one-node Slurm
cluster, a job that outgrows its --mem, checkpointed instead of OOM-killed, told to Slurm
(AdminComment), requeued with more memory, resumed by `oomguard resume-job`, finished intact.
Reported as skipped, with the reason, where the VM or Slurm cannot be set up; never passed."""

from __future__ import annotations

import os

import pytest

from tests.helpers import run_vm_lane


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_slurm_job_checkpointed_requeued_and_resumed(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_VM_LANE"):
        pytest.skip("already inside the v2 lane")
    # 3: tests/vmlane_slurm.sh found no Slurm to run
    result, wall = run_vm_lane(["bash", "tests/vmlane_slurm.sh"], 1500, skip_codes=(3, 77))
    output = result.stdout + result.stderr
    with capsys.disabled():
        print(f"\n[slurm lane] {wall:.0f} s wall, exit {result.returncode}")
        for line in output.splitlines():
            if line.startswith("[slurm-lane]"):
                print(line)
    assert result.returncode == 0, output[-8000:]
    assert "[slurm-lane] PASS" in output, output[-4000:]
