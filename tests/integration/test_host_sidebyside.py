"""Side by side on the workstation host (issue 27, item 7), in the host lane: the kernel alone
and oomguard, one after the other, on the same hogs (100 MB/s; MAP_POPULATE in one call) in a
slice with MemoryMax=256M. The kernel's OOM killer ends both jobs; oomguard checkpoints both
before that, and each restore finishes its job's count with its memory intact. The whole
comparison (earlyoom and systemd-oomd too, every hog) is scripts/bench-host; its results are in
bench/results/sidebyside.md. Skipped, with the lane's reason, only where the lane cannot run."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import REPO
from tests.host_lane import lane_values, run_host_lane


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_the_kernel_kills_where_oomguard_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_HOST_LANE") or os.environ.get("OOMGUARD_HOST_LANE"):
        pytest.skip("already inside the host lane")
    result, wall = run_host_lane(
        ["python3", "-I", str(REPO / "bench" / "sidebyside.py"), "--guards", "kernel,oomguard",
         "--hogs", "100mbs,populate", "--settle", "10"], 1200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    got = {key: json.loads(value) for key, value in lane_values(result.stdout).items()
           if key.startswith("run_")}
    with capsys.disabled():
        print(f"\n[host lane] {wall:.0f} s wall; "
              + "; ".join(f"{k[4:]}: {v['outcome']} {v['to_action_s']}" for k, v in got.items()))
    for hog in ("100mbs", "populate"):
        kernel, guarded = got[f"run_kernel_{hog}"], got[f"run_oomguard_{hog}"]
        assert kernel["outcome"] == ["killed (kernel)"], output[-4000:]
        # A job oomguard did not save: its journal and systemd-oomd's from that run, in full.
        said = [line for line in output.splitlines() if f"oomguard / {hog} journal:" in line]
        assert guarded["outcome"] == ["checkpointed"], "\n".join(said) or output[-4000:]
        assert guarded["restored"] == ["ok"], output[-4000:]
