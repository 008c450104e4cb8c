"""The terminal a person types into (issue 25, item 5), in a real terminal (tmux, an interactive
bash): a job gets the terminal's input only while it reads it, as a shell's job does, so lines
pasted after `oomguard exec` run in the shell; Ctrl-Z stops an exec job and says how to go on,
`fg` continues it; `attach` and an attached `restore` end as soon as the job ends, with its
exit status."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, CgroupFactory, MiB, daemon, kill_pid, run_cli
from tests.terminals import pids_running, stop_and_continue, tmux_shell

pytestmark = pytest.mark.integration
TTY_JOB = REPO / "tests" / "workloads" / "tty_job.py"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A short XDG_RUNTIME_DIR for exec's holders; the jobs left are ended."""
    runtime = Path(tempfile.mkdtemp(prefix="ogi-", dir="/tmp"))
    yield {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    for pid in pids_running(str(tmp_path)):
        kill_pid(pid)
    for pid in pids_running("--listen-fd"):  # holders of this test's jobs only
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(runtime).encode() in environ:
            kill_pid(pid)
    shutil.rmtree(runtime, ignore_errors=True)


def job(log: Path, *, target: int = 8, count: int = 60, tick: float = 0.05,
        exit_status: int = 0) -> str:
    return (f"{sys.executable} {TTY_JOB} --log {log} --target {target} --rate 60 "
            f"--count {count} --tick {tick} --exit {exit_status}")


def counts(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().splitlines() if line.isdigit()]


def test_lines_pasted_after_exec_run_in_the_shell(tmp_path: Path, env: dict[str, str]) -> None:
    """README's way: a block pasted at once; the job reads nothing, so the lines after it stay
    in the terminal for the shell, and `$?` is exec's status."""
    with tmux_shell("paste", tmp_path, env) as shell:
        shell.paste("oomguard exec -- python3 -c 'import time; print(\"job ran\", flush=True); "
                    "time.sleep(1)' > out.log\n"
                    'echo "exit status $?"\n'
                    "echo second-line\n")
        shell.wait_for("exit status 0")
        shell.wait_for("second-line\n")
        shell.wait_prompt(4)
        # Typed while a job runs that does not read: the line is the shell's, afterwards.
        since = shell.mark()
        shell.type("oomguard exec -- python3 -c 'import time; time.sleep(2)'")
        shell.wait_for("oomguard exec", since=since)
        shell.type("echo typed-$((6*7))")
        shell.wait_for("\ntyped-42\n", since=since)
    assert (tmp_path / "out.log").read_text() == "job ran\n"


def test_a_job_that_reads_gets_the_lines_typed_for_it(tmp_path: Path,
                                                      env: dict[str, str]) -> None:
    """A job that asks (input(): a read of its terminal) gets the line typed for it; the line
    pasted after it runs in the shell; a job that waits in select(2) gets a line typed once
    it runs."""
    with tmux_shell("reads", tmp_path, env) as shell:
        shell.paste("oomguard exec -- python3 -c 'print(\"got\", input(\"name? \"))'\n")
        shell.wait_for("name? ")
        shell.type("bob")
        shell.wait_for("got bob")
        shell.wait_prompt(2)
        log = tmp_path / "sel.log"
        shell.type(f"oomguard exec -- {job(log, count=400, tick=0.05)}")
        shell.wait_for("count 5")
        shell.type("hello there")
        shell.wait_for("echo: hello there")
        assert "input hello there" in log.read_text()


def test_ctrl_z_stops_an_exec_job_and_fg_continues_it(tmp_path: Path,
                                                       env: dict[str, str]) -> None:
    log = tmp_path / "z.log"
    with tmux_shell("ctrlz", tmp_path, env) as shell:
        shell.type(f"oomguard exec -- {job(log, count=120)}")
        shell.wait_for("count 5")
        pid = next(p for p in pids_running(str(log)) if "nsinit" not in
                   Path(f"/proc/{p}/cmdline").read_text())
        stopped_at = stop_and_continue(shell, pid, lambda: len(counts(log)))
        assert "the job is stopped; `fg` continues it" in shell.screen()
        shell.wait_for(f"count {stopped_at + 3}")
        shell.wait_prompt(4, timeout=60)  # the job ran to its end under exec
        assert "status 0" in shell.run('echo "status $?"')
    assert counts(log) == list(range(1, 121))


def test_attach_and_restore_end_with_the_job_and_its_status(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, env: dict[str, str]) -> None:
    """A job of `oomguard exec` checkpointed, restored with no terminal, attached from a
    prompt: when it exits (status 3) attach says so and returns 3 at once (it waited 30 s
    for a checkpoint that was not coming). Then the same with `restore` on a terminal."""
    small = cgroups.make("status", 128 * MiB)
    big = cgroups.make("statusbig", 512 * MiB)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard, \
            tmux_shell("status", tmp_path, env) as shell:
        guard.wait_event("guard.armed")
        argv = ["--store", str(store), "--socket", str(guard.socket)]
        flags = " ".join(argv)
        for n, log in enumerate(logs):
            prompts, since = shell.prompts(), shell.mark()
            shell.type(f"oomguard {flags} exec --cgroup {small.path} -- "
                       f"{job(log, target=160, count=200, exit_status=3)}")
            done = guard.wait_event("checkpoint.done", timeout=60, count=n + 1)[n]
            shell.wait_for(f"checkpointed as {done['id']}", since=since)
            shell.wait_prompt(prompts + 1)
            since = shell.mark()
            if n == 0:
                result = run_cli(*argv, "restore", done["id"], "--cgroup", str(big.path),
                                 env=env)
                assert result.returncode == 0, result.stderr
                shell.type(f"oomguard {flags} attach {done['id']}")
            else:
                shell.type(f"oomguard {flags} restore {done['id']} --cgroup {big.path}")
            shell.wait_for("the job exited with status 3", timeout=60, since=since)
            assert "status 3" in shell.run('echo "status $?"', timeout=10)
            assert counts(log) == list(range(1, 201))
