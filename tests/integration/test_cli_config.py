"""The CLI reads the config the service uses (--config before the subcommand, or
$OOMGUARD_CONFIG): with the daemon on a config that sets `socket` and `store`, status, list
and restore reach that daemon and that store without --socket or --store. A bad config stops
every subcommand with exit 2, naming the file and the key; a user who cannot read a root-only
config gets the default socket, quietly."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    hog_argv,
    kill_pid,
    last_count,
    run_cli,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration

DEFAULT_SOCKET = "/run/oomguard/control.sock"


def _environ(**extra: str) -> dict[str, str]:
    """This environment without an inherited $OOMGUARD_CONFIG, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "OOMGUARD_CONFIG"}
    env.update(extra)
    return env


def _write_config(path: Path, store: Path, sock: Path) -> Path:
    path.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{sock}"\n')
    return path


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_cli_reaches_the_daemon_and_store_of_its_config(
        how: str, cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    sock = short_socket_path()
    config = _write_config(tmp_path / "oomguard.toml", store, sock)
    daemon = DaemonProcess(store, tmp_path / "daemon.log", socket=sock, config=config,
                           env=_environ(), log_level="debug")
    flag = ["--config", str(config)] if how == "flag" else []
    env = _environ(OOMGUARD_CONFIG=str(config)) if how == "env" else _environ()
    cg = cgroups.make("cliconf", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=200, count=100_000))
    restored = None
    try:
        started = daemon.wait_event("guard.started")[0]
        assert started["config"] == str(config) and started["socket"] == str(sock)
        status = run_cli(*flag, "status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["daemon"]

        assert wait_until(lambda: last_count(log) > 10, 10)
        done = run_cli(*flag, "checkpoint", str(hog.pid), env=env)
        assert done.returncode == 0, done.stderr
        checkpoint_id = done.stdout.strip()
        hog.wait(timeout=10)
        assert (store / checkpoint_id / "meta.json").exists()  # the config's store
        assert [e["method"] for e in daemon.events("control.call")] == ["Status", "Checkpoint"]

        listed = run_cli(*flag, "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert [m["id"] for m in json.loads(listed.stdout)] == [checkpoint_id]
        status = run_cli(*flag, "status", "--json", env=env)
        assert json.loads(status.stdout)["checkpoints"]["count"] == 1

        back = run_cli(*flag, "restore", checkpoint_id, env=env)
        assert back.returncode == 0, back.stderr
        restored = int(back.stdout.strip())
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 5, 10), "the restored job died"
        methods = [e["method"] for e in daemon.events("control.call")]
        assert methods[-3:] == ["List", "Status", "Restore"]
    finally:
        if restored:
            kill_pid(restored)
        kill_pid(hog.pid)
        hog.wait(timeout=10)
        assert daemon.stop() == 0


def test_the_run_subcommands_config_flag_still_works(store: Path, tmp_path: Path) -> None:
    sock = short_socket_path()
    config = _write_config(tmp_path / "oomguard.toml", store, sock)
    daemon = DaemonProcess(store, tmp_path / "daemon.log", "--config", str(config),
                           socket=sock, config=None, env=_environ())
    # DaemonProcess without `config` also passes --socket (the same path) and --store.
    try:
        started = daemon.wait_event("guard.started")[0]
        assert started["config"] == str(config)
        status = run_cli("--config", str(config), "status", "--json", env=_environ())
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["daemon"]
    finally:
        assert daemon.stop() == 0


def test_config_given_twice_differently_is_refused(tmp_path: Path) -> None:
    one = _write_config(tmp_path / "one.toml", tmp_path / "s1", tmp_path / "c1.sock")
    other = _write_config(tmp_path / "other.toml", tmp_path / "s2", tmp_path / "c2.sock")
    result = run_cli("--config", str(one), "run", "--config", str(other), env=_environ())
    assert result.returncode == 2
    assert "--config: given twice" in result.stderr


BAD = '[daemon]\nsocket = 7\n\n[[guard]]\ncgroups = ["/x"]\nthreshold = "150%"\n'


@pytest.mark.parametrize("args", [
    ["status"], ["list"], ["show", "x"], ["restore", "x"], ["forget", "x"],
    ["checkpoint", "1"], ["attach", "1"], ["gpu-resume", "1"], ["resume-job", "--job", "1"],
    ["exec", "--", "true"], ["doctor"], ["run"], ["check-config"],
])
def test_a_bad_config_stops_every_subcommand_with_exit_2(args: list[str],
                                                         tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD)
    for flag, env in ((["--config", str(bad)], _environ()),
                      ([], _environ(OOMGUARD_CONFIG=str(bad)))):
        result = run_cli(*flag, *args, env=env, timeout=60)
        assert result.returncode == 2, (flag, result.stderr)
        for key in ("daemon.socket", "guard[0].threshold"):
            assert f"{bad}: {key}:" in result.stderr, result.stderr


def test_a_missing_config_named_by_the_environment_is_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    result = run_cli("list", env=_environ(OOMGUARD_CONFIG=str(missing)))
    assert result.returncode == 2
    assert f"{missing}: (file): cannot read" in result.stderr
    assert "OOMGUARD_CONFIG" in result.stderr


def _default_socket_answers() -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(DEFAULT_SOCKET)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_a_user_reads_a_readable_config_and_falls_back_quietly_from_a_root_only_one(
        store: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv(1) missing")
    uid = unprivileged_user("oomguard-t-cliconf", 40043)
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    sock = short_socket_path()
    # The user must reach the socket (0666) and the configs: they share a directory in /tmp
    # (pytest's tmp_path is root's alone); stop() removes it.
    etc = sock.parent
    etc.chmod(0o755)
    readable = _write_config(etc / "oomguard.toml", store, sock)
    readable.chmod(0o644)
    daemon = DaemonProcess(store, tmp_path / "daemon.log", socket=sock, config=readable,
                           env=_environ(), log_level="debug")
    request.addfinalizer(daemon.stop)
    daemon.wait_event("guard.started")
    status = run_cli("status", "--json", env=_environ(OOMGUARD_CONFIG=str(readable)),
                     as_user=as_user)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["daemon"]
    assert daemon.events("control.call")[-1]["uid"] == uid

    if _default_socket_answers():
        pytest.skip(f"a daemon answers on {DEFAULT_SOCKET} here")
    root_only = _write_config(etc / "root-only.toml", store, sock)
    root_only.chmod(0o600)
    fallback = run_cli("status", env=_environ(OOMGUARD_CONFIG=str(root_only)), as_user=as_user)
    assert fallback.returncode == 1
    assert f"no oomguard daemon answers on {DEFAULT_SOCKET}" in fallback.stderr
    assert "config" not in fallback.stderr and str(root_only) not in fallback.stderr
    # Named on the command line, the same file is an error: the user asked for it.
    named = run_cli("--config", str(root_only), "status", env=_environ(), as_user=as_user)
    assert named.returncode == 2
    assert f"{root_only}: (file): cannot read: Permission denied" in named.stderr


def test_install_units_says_what_it_wrote_and_what_comes_next(tmp_path: Path) -> None:
    dirs = ["--unit-dir", str(tmp_path / "units"), "--config-dir", str(tmp_path / "etc"),
            "--user-unit-dir", str(tmp_path / "user")]
    config = tmp_path / "etc" / "oomguard.toml"
    first = run_cli("install-units", *dirs, env=_environ())
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert f"installed {tmp_path / 'user' / 'oomguard-notify-agent.service'} (a user unit" in out
    assert f"installed {config} (the default config: it guards nothing yet)" in out
    assert f"1. add a [[guard]] rule to {config}" in out
    for command in ("systemctl daemon-reload", "systemctl enable --now oomguard",
                    "systemctl --user enable --now oomguard-notify-agent",
                    f"oomguard --config {config} status"):
        assert f"       {command}\n" in out, out
    unit = (tmp_path / "units" / "oomguard.service").read_text()
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.endswith(f" run --config {config}")
    stable = Path("/usr/local/bin/oomguard")
    if stable.exists() and stable.resolve() == Path(sys.executable).parent.joinpath(
            "oomguard").resolve():
        assert exec_start == f"ExecStart={stable} run --config {config}"

    # With a guard in the kept config the next step is systemctl; a bad one stops it all.
    config.write_text(config.read_text() + '\n[[guard]]\ncgroups = ["/jobs"]\n')
    again = run_cli("install-units", *dirs, env=_environ())
    assert again.returncode == 0, again.stderr
    assert f"kept {config} (1 guard rule)" in again.stdout and "[[guard]]" not in again.stdout
    assert "1. start the service" in again.stdout
    config.write_text('[daemon]\nsocket = 7\n')
    (tmp_path / "units" / "oomguard.service").unlink()
    bad = run_cli("install-units", *dirs, env=_environ())
    assert bad.returncode == 2 and f"{config}: daemon.socket:" in bad.stderr
    assert not (tmp_path / "units" / "oomguard.service").exists()
