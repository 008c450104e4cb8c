"""A store on NFS in the cgroup v2 VM lane (tests/vmlane_nfs.sh): the guest's kernel exports a
directory of the lane's scratch disk and mounts it over 127.0.0.1, and
tests/integration/test_nfs_store.py runs there against it (this host's kernel has no NFS).
Reported as skipped, with the reason, where the VM or the NFS programs are missing."""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers import run_vm_lane


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_a_store_on_nfs_in_the_v2_lane(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_VM_LANE"):
        pytest.skip("already inside the v2 lane")
    if os.environ.get("OOMGUARD_NFS_LANE") == "0":
        pytest.skip("the NFS lane is switched off (OOMGUARD_NFS_LANE=0)")
    # 3: tests/vmlane_nfs.sh found no NFS programs to run
    result, wall = run_vm_lane(["bash", "tests/vmlane_nfs.sh"], 1500, skip_codes=(3, 77))
    output = result.stdout + result.stderr
    with capsys.disabled():
        print(f"\n[nfs lane] {wall:.0f} s wall, exit {result.returncode}")
        for line in output.splitlines():
            if (line.startswith("[nfs-lane]") and "watchdog" not in line
                    and not line.startswith("[nfs-lane]   task")) \
                    or re.search(r"\d+ (passed|failed|skipped)", line):
                print(f"[nfs lane] {line}")
    assert result.returncode == 0, output[-8000:]
    counts = re.search(r"(\d+) passed", output)
    assert counts and int(counts.group(1)) == 6, output[-3000:]
    assert not re.search(r"\d+ (failed|error|skipped)", output), output[-3000:]
