"""Root never imports from the current directory (issue 26, item 2): a directory holding
hostile `oomguard/`, `config/`, `bench/` (and `tests/`, `structlog/`, `psutil/`) packages,
each of which would leave a marker on import, is the working directory of every CLI verb, of
the daemon (its standby, CRIU's action script at a checkpoint) and of eager and lazy restores
(the leader and the lazy-restore keeper): no marker appears, and the lazy restore's pages are
verified (its status says so). The CLI is its installed entry point (`oomguard`, beside this
Python), as root runs it; every Python process oomguard starts runs with -I."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.sense.procfs import ProcReader
from oomguard.store.names import STANDBY_RECORD
from tests.helpers import (
    CgroupFactory,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    parse_events,
    short_socket_path,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

HOSTILE = ("oomguard", "config", "bench", "tests", "structlog", "psutil")
ENTRY = Path(sys.executable).parent / "oomguard"


def hostile_directory(root: Path, markers: Path) -> Path:
    """`root/cwd` with a package per name of HOSTILE whose import writes `markers/NAME`
    (and, for oomguard, a __main__ and the modules oomguard's children run)."""
    cwd = root / "cwd"
    markers.mkdir(mode=0o777)
    for name in HOSTILE:
        package = cwd / name
        package.mkdir(parents=True)
        trap = (f"open({str(markers / name)!r} + '-' + __name__, 'w').write("
                "repr(__import__('sys').argv))\n")
        (package / "__init__.py").write_text(trap)
        if name == "oomguard":
            (package / "__main__.py").write_text(trap)
            for sub in ("cli", "daemon", "lifecycle", "terminal", "act"):
                (package / sub).mkdir()
                (package / sub / "__init__.py").write_text(trap)
    return cwd


def oomguard(cwd: Path, env: dict[str, str], *args: str, timeout: float = 120,
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ENTRY), "--log-format", "json", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_no_verb_the_daemon_or_a_restore_imports_from_the_current_directory(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    if not ENTRY.is_file():
        pytest.skip(f"no installed entry point {ENTRY}")
    markers = tmp_path / "markers"
    cwd = hostile_directory(tmp_path, markers)
    store, sock = tmp_path / "store", short_socket_path()
    config = tmp_path / "oomguard.toml"
    guarded = cgroups.make("guarded", 256 * MiB)
    roomy = cgroups.make("roomy", None)
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{sock}"\n\n'
                      f'[[guard]]\ncgroups = ["{guarded.path}"]\n')
    env = {k: v for k, v in os.environ.items() if k not in ("OOMGUARD_SOCKET", "PYTHONPATH")}
    env["OOMGUARD_CONFIG"] = str(config)

    def clean() -> None:
        assert not list(markers.iterdir()), [
            (p.name, p.read_text()) for p in markers.iterdir()]

    ran: dict[str, int] = {}
    for verb in (["--version"], ["check-config", str(config)], ["doctor"], ["list"],
                 ["status"], ["install-units", "--unit-dir", str(tmp_path / "units"),
                              "--config-dir", str(tmp_path / "etc"), "--user-unit-dir",
                              str(tmp_path / "user-units")]):
        ran[verb[0]] = oomguard(cwd, env, *verb).returncode
    assert ran["check-config"] == ran["list"] == ran["--version"] == 0, ran
    clean()

    log = tmp_path / "daemon.log"
    restored: list[int] = []
    with open(log, "wb") as out:
        daemon = subprocess.Popen([str(ENTRY), "--log-format", "json", "run"], cwd=cwd, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    agent = subprocess.Popen([str(ENTRY), "notify-agent"], cwd=cwd, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: "guard.ready" in log.read_text(), 60), log.read_text()
        assert wait_until(lambda: (store / STANDBY_RECORD).exists(), 30)
        # A crossing: the daemon's checkpoint (CRIU runs its action script).
        crossing = tmp_path / "crossing.log"
        hog = start_in_cgroup(guarded, hog_argv(crossing, target=400, rate=300, count=100_000))
        assert wait_until(lambda: '"checkpoint.done"' in log.read_text(), 90), \
            log.read_text()[-3000:]
        assert hog.wait(timeout=10) == -signal.SIGKILL
        crossed = next(e for e in parse_events(log.read_text()) if e["event"] ==
                       "checkpoint.done")
        # On demand, then an eager and a lazy restore through the daemon, into roomy.
        lazy_log = tmp_path / "lazy.log"
        job = start_in_cgroup(roomy, hog_argv(lazy_log, target=64, rate=400, count=100_000))
        assert wait_until(lambda: last_count(lazy_log) > 30, 30)
        taken = oomguard(cwd, env, "checkpoint", str(job.pid))
        assert taken.returncode == 0, taken.stderr
        job.wait(timeout=10)
        on_demand = taken.stdout.strip()
        for verb in (["list"], ["show", on_demand], ["status"]):
            assert oomguard(cwd, env, *verb).returncode == 0, verb
        eager = oomguard(cwd, env, "restore", crossed["id"], "--cgroup", str(roomy.path),
                         "--detach")
        assert eager.returncode == 0, eager.stderr
        restored.append(int(eager.stdout.split()[0]))
        lazy = oomguard(cwd, env, "restore", "--lazy", on_demand, "--cgroup", str(roomy.path),
                        "--detach")
        assert lazy.returncode == 0, lazy.stderr
        restored.append(int(lazy.stdout.split()[0]))
        done = next(e for e in parse_events(lazy.stderr) if e.get("event") == "restore.done")
        assert done["lazy"] is True, done
        status_file = store / on_demand / "lazy.json"
        status = wait_until(lambda: status_file.exists() and json.loads(status_file.read_text())
                            .get("verified_at") and json.loads(status_file.read_text()), 60)
        assert status and status["outcome"] == "resident", status
        before = last_count(lazy_log)
        assert wait_until(lambda: last_count(lazy_log) > before + 5, 30)  # it runs on
        # The verbs that refuse here (no terminal, no GPU, no Slurm job) still start clean.
        for verb in (["attach", str(restored[-1])], ["gpu-resume", str(restored[-1])],
                     ["resume-job", "--job", "1", "--no-wait"], ["forget", crossed["id"]],
                     ["exec", "--", "true"], ["exec", "--cgroup", str(roomy.path), "--",
                                              "true"]):
            result = oomguard(cwd, env, *verb)
            assert "Traceback" not in result.stderr, (verb, result.stderr)
            ran[verb[0]] = result.returncode
        assert ran["forget"] == ran["exec"] == 0, ran
    finally:
        for pid in restored:
            kill_pid(pid)
        agent.terminate()
        agent.wait(timeout=10)
        daemon.terminate()
        assert daemon.wait(timeout=120) == 0, log.read_text()[-3000:]
        shutil.rmtree(sock.parent, ignore_errors=True)
    assert wait_until(lambda: not [p for p in restored if ProcReader().exists(p)
                                   and ProcReader().state(p) != "Z"], 10)
    clean()
    print(f"verbs and their status: {ran}")
