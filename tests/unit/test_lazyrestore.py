"""oomguard.lifecycle.lazyrestore: what it runs and what it waits for (the real thing:
tests/integration/test_lazy_restore.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from oomguard.act.criu import Criu
from oomguard.lifecycle import lazyrestore
from oomguard.lifecycle.lazyrestore import lazy_pages_argv, running_keepers, wait_for_keepers


def test_lazy_pages_daemon_argv(tmp_path: Path) -> None:
    criu = Criu(binary="/usr/local/sbin/criu", version=(4, 2))
    assert lazy_pages_argv(criu, tmp_path / "images", tmp_path) == [
        "/usr/local/sbin/criu", "lazy-pages", "--images-dir", str(tmp_path / "images"),
        "--work-dir", str(tmp_path), "--log-file", "lazy-pages.log", "-v3", "--daemon",
        "--pidfile", str(tmp_path / "lazy-pages.pid")]


def test_the_daemon_waits_for_its_keepers_and_reaps_them() -> None:
    short = subprocess.Popen(["sleep", "0.3"])
    long = subprocess.Popen(["sleep", "30"])
    lazyrestore._KEEPERS[:] = [short, long]
    try:
        assert running_keepers() == 2
        start = time.monotonic()
        assert wait_for_keepers(1.0) == 1  # the long one is still streaming pages in
        assert 0.9 < time.monotonic() - start < 5
        assert short.returncode == 0  # reaped: no zombie left behind
    finally:
        long.kill()
        long.wait()
        lazyrestore._KEEPERS.clear()
    assert running_keepers() == 0 and wait_for_keepers(10.0) == 0
