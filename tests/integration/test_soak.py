"""The soak drill in the suite: 3 minutes of scripts/soak (20 guarded cgroups, up to two
random hogs in each at a time, half of them writing a file through write(2), random restores,
the daemon SIGKILLed and restarted). Every invariant must hold: no job lost (none to ENOMEM,
none OOM-killed), none left stopped, no limit changed."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_three_minutes_of_soak_lose_nothing(tmp_path: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="oomguard-soak-", dir="/var/tmp"))
    result = subprocess.run([str(REPO / "scripts" / "soak"), "3", "--seed", "20261201",
                             "--workdir", str(workdir), "--out", str(tmp_path / "soak.md")],
                            capture_output=True, text=True, timeout=840, cwd=REPO,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    table = (tmp_path / "soak.md").read_text()
    assert "| invariants broken | 0 |" in table, table
    assert "| jobs lost to ENOMEM | 0 |" in table and "| jobs OOM-killed | 0 |" in table
    assert "| jobs at a time in one cgroup (at most) | 2 |" in table
    assert "| jobs writing a file through write(2) | 0 |" not in table
    assert "| checkpoints | 0 |" not in table and "| restores | 0 |" not in table
