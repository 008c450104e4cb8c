"""A system-wide rule (no cgroup limit: MemAvailable, like earlyoom) on the real machine: a hog
that eats into MemAvailable past the floor is checkpointed. The floor is set just below what is
available now, so a ~700 MiB hog crosses it; candidates are confined to the test's cgroup so no
process the test did not start is ever touched."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    start_in_cgroup,
)

pytestmark = pytest.mark.integration


def test_system_rule_checkpoints_the_hog_before_memavailable_floor(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("system", None)
    floor = psutil.virtual_memory().available - 400 * MiB
    config = tmp_path / "system.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\npoll_interval = "50ms"\n\n'
                      f'[[guard]]\nsystem = true\nmin_available = {floor}\n'
                      f'victim_cgroups = ["{cg.path}"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        armed = guard.wait_event("guard.armed")[0]
        assert armed["cgroup"] == "system" and "MemAvailable" in armed["detection"]
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=900, rate=200,
                                           count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert hog.wait(timeout=10) == -signal.SIGKILL
    crossed = guard.events("threshold.crossed")[0]
    assert crossed["cgroup"] == "system" and crossed["available"] <= floor
    assert done["pid"] == hog.pid
    assert 300 * MiB < done["image_bytes"] < 900 * MiB
