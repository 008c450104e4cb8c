"""README's "Your first ten minutes", run exactly as written: the block between the
first-ten-minutes markers goes to bash with only its paths moved (the cgroup beneath this
test's own memory cgroup, /etc/oomguard, the store, the socket, the log and the metrics port
into a scratch directory) and `oomguard` first on PATH from this checkout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, CgroupFactory, kill_pid, read_counts, wait_until

BEGIN, END = "<!-- first-ten-minutes:begin -->", "<!-- first-ten-minutes:end -->"
README_CGROUP = "/sys/fs/cgroup/memory/demo"


def readme_walkthrough() -> str:
    text = (REPO / "README.md").read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert block.startswith("```sh\n") and block.endswith("```"), block[:40]
    return block[len("```sh\n"):-len("```")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def moved(script: str, paths: dict[str, str]) -> str:
    for old, new in paths.items():
        assert old in script, f"README's walkthrough no longer mentions {old}"
        script = script.replace(old, new)
    return script


def walkthrough_moved(cgroup: Path, tmp_path: Path) -> tuple[str, Path, Path]:
    """README's walkthrough with its paths in `tmp_path` (the cgroup beneath the test's own,
    a free metrics port): (the script, the config's directory, the working directory)."""
    etc, work = tmp_path / "etc-oomguard", tmp_path / "home"
    work.mkdir()
    script = moved(readme_walkthrough(), {
        README_CGROUP: str(cgroup),
        "/etc/oomguard": str(etc),
        "/var/lib/oomguard": str(tmp_path / "store"),
        "/run/oomguard/control.sock": str(tmp_path / "control.sock"),
        "/var/log/oomguard-demo.log": str(tmp_path / "daemon.log"),
        "9464": str(free_port()),
    })
    return script, etc, work


def test_readme_first_ten_minutes_as_written(cgroups: CgroupFactory, tmp_path: Path) -> None:
    demo = cgroups.make("demo", None)  # the README's mkdir -p finds it; its echo sets the limit
    script, etc, work = walkthrough_moved(demo.path, tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           # the README relies on /etc/oomguard/oomguard.toml being found: moved, it is found so
           "OOMGUARD_CONFIG": str(etc / "oomguard.toml")}
    env.pop("OOMGUARD_SOCKET", None)
    result = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                            text=True, timeout=240, stdin=subprocess.DEVNULL)
    out = result.stdout
    shown = f"stdout:\n{out}\nstderr:\n{result.stderr}\ndaemon log:\n" + (
        (tmp_path / "daemon.log").read_text() if (tmp_path / "daemon.log").exists() else "")
    assert result.returncode == 0, shown
    # 2: the config checks out and the daemon guards the cgroup
    assert "OK (1 guard rule(s))" in out, shown
    assert "daemon: running" in out and str(demo.path) in out, shown
    # 3: exec reported the checkpoint
    assert "exit status 75" in out, shown
    # 4: list / show name it; the job had stopped counting part-way
    ids = set(re.findall(r"\b(\d{8}-\d{6}-\d+-[0-9a-f]+)\b", out))
    assert len(ids) == 1, shown
    assert re.search(r"^state +checkpointed$", out, re.M), shown
    # 5: restored, and the same process went on: every number once, in order, then done
    assert re.search(r"restored \S+ as PID \d+ \(was \d+\)", out + result.stderr), shown
    log = work / "demo.log"
    assert read_counts(log) == list(range(100)), log.read_text()
    assert log.read_text().rstrip().endswith("done"), log.read_text()
    # 6: the metrics count one checkpoint and one restore
    metrics = dict(re.findall(r"^(oomguard_\w+_total\{[^}]*\}) (\S+)$", out, re.M))
    assert any(k.startswith("oomguard_checkpoints_total") and float(v) >= 1
               for k, v in metrics.items()), shown
    assert any(k.startswith("oomguard_restores_total") and "failed" not in k and float(v) >= 1
               for k, v in metrics.items()), shown


def readme_blocks(script: str) -> list[str]:
    """The walkthrough's numbered blocks (`# 1. ...` up to the next), as a person pastes them
    one at a time."""
    blocks: list[list[str]] = []
    for line in script.splitlines():
        if re.match(r"# \d+\. ", line) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    return ["\n".join(block).strip() + "\n" for block in blocks if "".join(block).strip()]


def test_readme_first_ten_minutes_pasted_block_by_block_into_a_terminal(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    """The same walkthrough pasted into a real terminal (tmux, an interactive bash), one
    block at a time, each run to its end: nothing the shell should run is read by a job
    (`echo "exit status $?"` runs right after exec), restore attaches and ends with the job,
    and the daemon started in the background is stopped by the last block's `kill %1`."""
    from tests.terminals import pids_running, tmux_shell

    demo = cgroups.make("pasted", None)
    script, etc, work = walkthrough_moved(demo.path, tmp_path)
    env = {**os.environ, "OOMGUARD_CONFIG": str(etc / "oomguard.toml"),
           "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("OOMGUARD_SOCKET", None)
    try:
        with tmux_shell("readme", work, env) as shell:
            for number, block in enumerate(readme_blocks(script), start=1):
                since = shell.mark()
                shell.paste(block)
                # Typed after the paste: the shell runs it once the whole block has run.
                shell.type(f"echo block-done-$(( {number} * 1000 ))")
                shell.wait_for(f"\nblock-done-{number * 1000}\n", timeout=120, since=since)
            out = shell.screen()
            stopped = wait_until(lambda: '"guard.stopped"' in (tmp_path / "daemon.log")
                                 .read_text(), 30)  # by the last block's `kill %1`
    finally:
        for pid in pids_running(str(etc / "oomguard.toml")):
            kill_pid(pid)
    shown = f"terminal:\n{out[-6000:]}\ndaemon log:\n" + (
        (tmp_path / "daemon.log").read_text() if (tmp_path / "daemon.log").exists() else "")
    assert "OK (1 guard rule(s))" in out, shown
    assert "daemon: running" in out, shown
    assert "exit status 75" in out, shown
    ids = set(re.findall(r"\b(\d{8}-\d{6}-\d+-[0-9a-f]+)\b", out))
    assert len(ids) == 1, shown
    assert re.search(r"restored \S+ as PID \d+ \(was \d+\)", out), shown
    assert "the job exited with status 0" in out, shown  # restore attached, ended with it
    log = work / "demo.log"
    assert read_counts(log) == list(range(100)), log.read_text()
    assert log.read_text().rstrip().endswith("done"), log.read_text()
    assert re.search(r"^oomguard_checkpoints_total\{[^}]*\} [1-9]", out, re.M), shown
    assert stopped, shown
