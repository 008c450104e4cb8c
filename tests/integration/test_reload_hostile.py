"""A reload never kills the daemon (issue 26, item 8): a config that is not UTF-8 or nested
deeper than the TOML parser descends is rejected on SIGHUP like any other bad config (the
old rules stay, the daemon guards on), and refused at start with a one-line error naming the
file (exit 2); hooks a reload adds run at the next checkpoint."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    oomguard_argv,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

NOT_UTF8 = b'[daemon]\nstore = "/var/lib/\xff\xfeoomguard"\n'
NESTED = ("x = " + "[" * 4000 + "]" * 4000 + "\n").encode()
NESTED_TABLES = ("x = " + "{a = " * 4000 + "1" + "}" * 4000 + "\n").encode()


@pytest.mark.parametrize("content", [NOT_UTF8, NESTED, NESTED_TABLES],
                         ids=["not-utf8", "nested-arrays", "nested-tables"])
def test_such_a_config_at_start_is_one_line_and_exit_2(store: Path, tmp_path: Path,
                                                       content: bytes) -> None:
    config = tmp_path / "hostile.toml"
    config.write_bytes(content)
    for argv in (oomguard_argv(store, "--config", str(config), "run"),
                 oomguard_argv(store, "check-config", str(config)),
                 oomguard_argv(store, "--config", str(config), "list")):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO,
                                stdin=subprocess.DEVNULL)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (argv, result.stderr)
        assert len(lines) == 1 and str(config) in lines[0], (argv, result.stderr)
        assert "Traceback" not in result.stderr
    assert not store.exists()


def test_sighup_with_hostile_configs_keeps_the_daemon_and_a_reload_adds_a_hook(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("reload", 256 * MiB)
    config = tmp_path / "oomguard.toml"
    good = f'[[guard]]\ncgroups = ["{cg.path}"]\n'
    config.write_text(good)
    marker = tmp_path / "hook-ran"
    proc = DaemonProcess(store, tmp_path / "daemon.log", "--config", str(config))
    try:
        proc.wait_event("guard.ready", timeout=60)
        for count, (content, said) in enumerate([(NOT_UTF8, "not UTF-8"),
                                                 (NESTED, "nested too deeply"),
                                                 (NESTED_TABLES, "nested too deeply")], 1):
            config.write_bytes(content)
            proc.handle.send_signal(signal.SIGHUP)
            rejected = proc.wait_event("config.rejected", count=count, timeout=20)[-1]
            assert any(said in issue and str(config) in issue for issue in rejected["issues"])
            assert proc.handle.poll() is None, proc.log.read_text()[-3000:]
        assert not proc.events("config.reloaded")

        # A reload that adds a hook: it runs at the next checkpoint (the old rule stands).
        config.write_text(good + f'\n[hooks]\non_checkpoint = \'echo "$OOMGUARD_ID" > '
                          f'{marker}\'\n')
        proc.handle.send_signal(signal.SIGHUP)
        reloaded = proc.wait_event("config.reloaded", timeout=20)[0]
        assert reloaded["hooks"] == ["on_checkpoint"]
        assert not [e for e in proc.events("config.restart_needed") if "hook" in e["key"]]
        proc.wait_event("guard.armed", count=2, timeout=20)
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                           count=100_000))
        done = proc.wait_event("checkpoint.done", timeout=90)[0]
        assert done["pid"] == hog.pid
        assert hog.wait(timeout=10) == -signal.SIGKILL
        assert wait_until(lambda: marker.exists() and marker.read_text().strip(), 20), \
            proc.log.read_text()[-3000:]
        assert marker.read_text().strip() == done["id"]
    finally:
        assert proc.stop() == 0
    assert cg.snapshot().oom_kills == 0
