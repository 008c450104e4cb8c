"""The kill drill in the suite: 15 points of scripts/killdrill (bench/killdrill.py), the real
daemon SIGKILLed at seeded random moments of a checkpoint (freeze, limit lift, dump, commit)
and of a restore, then restarted. After every restart nothing is left stopped, the limit is
the configured one, a dump CRIU had begun ends whole, and the job runs on or restores from a
whole checkpoint and counts to its end. The 200-point run: bench/results/killdrill.md."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_the_daemon_killed_at_fifteen_moments_leaves_nothing_stopped_or_lost(
        tmp_path: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="oomguard-killdrill-", dir="/var/tmp"))
    result = subprocess.run([str(REPO / "scripts" / "killdrill"), "--points", "15",
                             "--calibrate", "2", "--seed", "20261203", "--workdir",
                             str(workdir), "--out", str(tmp_path / "killdrill.md")],
                            capture_output=True, text=True, timeout=560, cwd=REPO,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    table = (tmp_path / "killdrill.md").read_text()
    assert "| points | 15 |" in table and "| points failed | 0 |" in table, table
    for phase in ("freeze", "lift", "dump", "commit", "restore"):
        assert f"| points in {phase} | 3 |" in table, table
