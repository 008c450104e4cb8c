from __future__ import annotations

import os
import shutil
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
def cgroups(request: pytest.FixtureRequest) -> Iterator[CgroupFactory]:
    parent = own_memory_cgroup()
    assert parent is not None
    tag = f"{os.getpid()}-{request.node.name[:40]}".replace("[", "-").replace("]", "")
    made = CgroupFactory(parent=parent, tag=tag)
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint store, deleted after the test (images are large; in the VM lane /tmp is RAM)."""
    path = tmp_path / "store"
    yield path
    shutil.rmtree(path, ignore_errors=True)
