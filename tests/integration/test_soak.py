"""The soak drill in the suite: 3 minutes of scripts/soak (20 guarded cgroups, up to two
random hogs in each at a time, half of them writing a file through write(2), random restores,
the daemon SIGKILLed and restarted). Every invariant must hold: no job lost (none to ENOMEM,
none OOM-killed), none left stopped, no limit changed."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO, kill_pid, own_memory_cgroup, wait_until

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


def _left_behind(workdir: Path, tag: str) -> list[str]:
    """What an interrupted drill must not leave: processes started from its work directory
    (daemon, standby, hogs), a mount beneath it (the small store), cgroups it made."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(workdir) in argv:
                found.append(f"pid {entry.name}: {argv[:120]}")
    mounts = Path("/proc/self/mountinfo").read_text()
    found += [f"mount {line.split()[4]}" for line in mounts.splitlines()
              if line.split()[4].startswith(str(workdir))]
    parent = own_memory_cgroup()
    if parent is not None:
        found += [f"cgroup {p}" for p in parent.path.iterdir() if tag in p.name]
    return found


@pytest.mark.timeout(300)
def test_an_interrupted_drill_leaves_nothing_behind(tmp_path: Path) -> None:
    """Ctrl-C in the terminal a drill runs in: its daemon stops first, then its jobs, its
    cgroups and its small store's loop mount go (SIGINT at its default, as a shell gives it)."""
    workdir = Path(tempfile.mkdtemp(prefix="oomguard-soak-int-", dir="/var/tmp"))
    drill = subprocess.Popen(
        [str(REPO / "scripts" / "soak"), "5", "--seed", "7", "--small-store", "512", "--keep",
         "--workdir", str(workdir)], cwd=REPO, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "soak.err", "wb"),  # noqa: SIM115
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        log = workdir / "daemon.log"
        assert wait_until(lambda: log.exists() and '"guard.armed"' in log.read_text()
                          and (workdir / "j0002.log").exists(), 120), \
            (tmp_path / "soak.err").read_text()[-3000:]
        assert _left_behind(workdir, f"soak{drill.pid}"), "the drill is not running as thought"
        drill.send_signal(signal.SIGINT)
        drill.wait(timeout=90)
        assert _left_behind(workdir, f"soak{drill.pid}") == []
    finally:
        if drill.poll() is None:
            drill.kill()
            drill.wait()
        _tidy(workdir, f"soak{drill.pid}")


def _tidy(workdir: Path, tag: str) -> None:
    """After a failure: what the drill left, taken down (its daemon by SIGTERM, so that it
    puts back what it set; the standby it then relieves), then its mount and cgroups."""
    for item in _left_behind(workdir, tag):
        if item.startswith("pid "):
            pid = int(item.split()[1].rstrip(":"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            if not wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists(), 30):
                kill_pid(pid)
    for item in _left_behind(workdir, tag):
        if item.startswith("mount "):
            subprocess.run(["umount", item.split(" ", 1)[1]], check=False)
        elif item.startswith("cgroup "):
            for path in sorted(Path(item.split(" ", 1)[1]).glob("**/"), reverse=True):
                with contextlib.suppress(OSError):
                    path.rmdir()
    shutil.rmtree(workdir, ignore_errors=True)
