from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.act.criu import find_criu
from oomguard.model.errors import CriuError
from tests.helpers import CgroupFactory, own_memory_cgroup


def _integration_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if own_memory_cgroup() is None:
        return "no memory cgroup controller on this machine"
    try:
        find_criu()
    except CriuError as exc:
        return str(exc)
    if shutil.which("unshare") is None:
        return "unshare (util-linux) missing"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _integration_skip_reason()
    if reason is None:
        return
    for item in items:
        if "integration" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def cgroups(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CgroupFactory]:
    parent = own_memory_cgroup()
    assert parent is not None
    tag = f"{os.getpid()}-{request.node.name[:40]}".replace("[", "-").replace("]", "")
    made = CgroupFactory(parent=parent, tag=tag)
    try:
        yield made
    finally:
        made.cleanup()
        # A paged-out job's swap file, which `store` could not switch off while the job
        # lived at its cgroup's limit (swapoff needs room to read its pages back in)
        switch_off_swap_under(tmp_path)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint store, deleted after the test (images are large; in the VM lane /tmp is RAM).
    A swap file a page-out made in it and a test left on (the default chain pages out what
    CRIU refuses) is switched off first: on, it would change how every later test's memory
    behaves at its limit (the kernel swaps instead of reclaiming or OOM-killing)."""
    path = tmp_path / "store"
    yield path
    switch_off_swap_under(path)
    shutil.rmtree(path, ignore_errors=True)


def switch_off_swap_under(path: Path) -> None:
    """swapoff and delete every active swap area in `path` (read from /proc/swaps)."""
    prefix = str(path) + "/"
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        area = line.split()[0].replace("\\040", " ")
        if area.startswith(prefix):
            done = subprocess.run(["swapoff", area], check=False, capture_output=True)
            if done.returncode == 0:
                Path(area).unlink(missing_ok=True)
