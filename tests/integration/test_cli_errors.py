"""Clear errors, never tracebacks (issue 26, item 11), as the attacker typed them: `exec` as a
real unprivileged user (useradd) and with a `--cgroup` holding `..` or a relative path, a
`--store` that does not exist, `list` with no daemon answering, and `restore --wait` of a
checkpoint larger than its cgroup could ever hold (directly and through the daemon)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    cli_argv,
    daemon,
    hog_argv,
    last_count,
    oomguard_argv,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration

USER_UID = 40726


def _run(argv: list[str], *, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None,
         cwd: Path = REPO, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, stdin=subprocess.DEVNULL, env=env)


def _one_line(result: subprocess.CompletedProcess[str], status: int, *said: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    for words in said:
        assert words in lines[0], (words, lines[0])
    return lines[0]


def _refusal(result: subprocess.CompletedProcess[str], *said: str) -> str:
    """A restore refused: exit status 1, its `restore.failed` event and one line that says
    why, with the figures."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("oomguard: ")]
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    for words in said:
        assert words in lines[0], (words, lines[0])
    return lines[0]


def test_exec_as_a_user_and_with_a_bad_cgroup_is_one_line_and_exit_2(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv(1) missing")
    cg = cgroups.make("exec", 256 * MiB)
    uid = unprivileged_user("oomguard-t-h1exec", USER_UID)
    as_user = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--")
    marker = tmp_path / "ran"
    tmp_path.chmod(0o777)
    started = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for cgroup in ([], ["--cgroup", str(cg.path)]):
        result = _run(cli_argv("exec", *cgroup, "--", *started), prefix=as_user, cwd=tmp_path)
        _one_line(result, 2, "exec:", "needs root")
        assert not marker.exists()
    parent = str(cg.path.parent)
    for bad, why in [(f"{parent}/../{cg.path.name}", "'..'"), ("relative/job", "absolute"),
                     (f"{cg.path.name}/..", "absolute"),
                     (f"{parent}/no-such-cgroup-here", "no such memory cgroup")]:
        result = _run(cli_argv("exec", "--cgroup", bad, "--", *started))
        _one_line(result, 2, "--cgroup", why)
        assert not marker.exists()
    assert _run(cli_argv("exec", "--cgroup", str(cg.path), "--", *started)).returncode == 0
    assert marker.exists()


def test_a_store_that_is_not_there_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-store"
    for verb in (["list"], ["list", "--json"], ["show", "last"], ["status"],
                 ["restore", "last"], ["forget", "last"]):
        result = _run(oomguard_argv(missing, *verb))
        _one_line(result, 2, f"--store {missing}", "no such directory")
        assert result.stdout == ""
    assert not missing.exists()


def test_list_says_when_no_daemon_answers(store: Path, tmp_path: Path) -> None:
    sock = tmp_path / "nobody-here.sock"
    config = tmp_path / "oomguard.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{sock}"\n')
    env = {**os.environ, "OOMGUARD_CONFIG": str(config)}
    result = _run(cli_argv("list"), env=env)
    _one_line(result, 0, f"no daemon answers on {sock}", str(store))
    assert result.stdout.startswith("ID ")
    sock2 = short_socket_path()
    try:
        with daemon(store, tmp_path / "daemon.log", socket=sock2) as guard:
            guard.wait_event("guard.ready", timeout=60)
            answered = _run(cli_argv("--socket", str(sock2), "list"), env=env)
            assert answered.returncode == 0 and answered.stderr == "", answered.stderr
    finally:
        shutil.rmtree(sock2.parent, ignore_errors=True)


def test_restore_wait_of_a_checkpoint_larger_than_the_cgroup_is_refused_with_figures(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    roomy = cgroups.make("roomy", None)
    small = cgroups.make("small", 64 * MiB)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(roomy, hog_argv(log, target=128, rate=400, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 40, 30), log.read_text()[-300:]
        taken = _run(oomguard_argv(store, "checkpoint", str(hog.pid)), timeout=120)
        assert taken.returncode == 0, taken.stderr
        checkpoint_id = taken.stdout.strip()
    finally:
        hog.wait(timeout=30)
    # Directly (the limit), then through a daemon that guards the small cgroup (its rule).
    began = time.monotonic()
    direct = _run(oomguard_argv(store, "restore", checkpoint_id, "--cgroup", str(small.path),
                                "--wait", "--detach"), timeout=60)
    line = _refusal(direct, "limited to 64 MiB", "never fit", str(small.path))
    assert "needs 1" in line  # 128 MiB of pages and the margin
    sock = short_socket_path()
    try:
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path),
                    socket=sock) as guard:
            guard.wait_event("guard.ready", timeout=60)
            remote = _run(oomguard_argv(store, "--socket", str(sock), "restore", checkpoint_id,
                                        "--cgroup", str(small.path), "--wait", "--detach"),
                          timeout=60)
    finally:
        shutil.rmtree(sock.parent, ignore_errors=True)
    _refusal(remote, "even with nothing else in it", "of 64 MiB", "--force")
    assert "waiting until it fits" not in direct.stderr + remote.stderr
    assert time.monotonic() - began < 30
    assert not small.procs()
    print(f"direct: {line}\nthrough the daemon: {remote.stderr.strip().splitlines()[-1]}")
