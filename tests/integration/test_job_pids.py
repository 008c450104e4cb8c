"""The PID a person sees, and the job's own command (issue 25, items 2 and 6), the way a person
does it: a real terminal (tmux on a private socket, a `bash -i` prompt, keys typed), a job
started with `oomguard exec` typed at the prompt (a multi-line `python3 -c`), its PID read
from `ps`, `oomguard checkpoint PID` typed in another pane, then `list`, `show PID`,
`restore ID` and `attach PID`, with a real daemon, real cgroups and the real CRIU. And the
daemon's own victim choice: a system rule takes the whole job of its largest process; a cgroup
rule refuses, before stopping anything, a tree whose job's init is outside its cgroup."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from oomguard.store.checkpoints import Store
from oomguard.terminal.client import request
from oomguard.terminal.execwrap import EXIT_CHECKPOINTED
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    oomguard_argv,
    proc_state,
    read_counts,
    short_socket_path,
    unprivileged_user,
    wait_until,
)
from tests.terminals import TmuxShell

pytestmark = pytest.mark.integration
TTY_JOB = REPO / "tests" / "workloads" / "tty_job.py"
WIDTH = 160  # the tmux window's columns


@pytest.fixture
def person(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A person's environment: `oomguard` on PATH (this checkout's), the config the daemon's
    socket and store are found by, a short XDG_RUNTIME_DIR for terminal holders, and no
    $COLUMNS (the terminal's width is read from the terminal)."""
    runtime = Path(tempfile.mkdtemp(prefix="ogp-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               XDG_RUNTIME_DIR=str(runtime), OOMGUARD_CONFIG=str(tmp_path / "oomguard.toml"),
               TERM="xterm", HISTFILE="/dev/null")
    env.pop("OOMGUARD_SOCKET", None)
    yield env, runtime
    for sock in (runtime / "oomguard").glob("*.sock"):
        with contextlib.suppress(Exception):
            request(sock, "done", timeout=2)
    shutil.rmtree(runtime, ignore_errors=True)


def pids_in_ps(output: list[str], command_start: str) -> list[int]:
    """From `ps -eo pid=,args=`: the PIDs whose command begins `command_start`, as a person
    reads the listing (the wrapper's and the init's command lines hold it only after theirs)."""
    found = []
    for line in output:
        pid, _, args = line.strip().partition(" ")
        if pid.isdigit() and args.strip().startswith(command_start):
            found.append(int(pid))
    return found


def ns_pid(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def gone(pid: int) -> bool:
    return proc_state(pid) in (None, "Z", "X")


def test_checkpoint_of_the_pid_from_ps_takes_the_whole_exec_job_in_a_real_terminal(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        person: tuple[dict[str, str], Path]) -> None:
    env, _runtime = person
    cg = cgroups.make("pids", 512 * MiB)  # roomy: nothing here is checkpointed but on demand
    log = tmp_path / "job.log"
    socket_path = tmp_path / "control.sock"
    (tmp_path / "oomguard.toml").write_text(
        f'[daemon]\nstore = "{store}"\nsocket = "{socket_path}"\n')
    shell = TmuxShell("pids", tmp_path, env, width=WIDTH)
    job_pids: list[int] = []
    try:
        with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                    socket=socket_path) as guard:
            guard.wait_event("guard.armed")
            first, second = shell, shell.split()
            # Typed as README's example is: a multi-line `python3 -c` (this one runs the
            # counting terminal job), one line at a time.
            first.type(f"oomguard exec --cgroup {cg.path} -- python3 -c 'import runpy, sys")
            first.type(f'sys.argv = ["tty_job", "--log", "{log}", "--target", "48", '
                              '"--rate", "100", "--count", "100000", "--tick", "0.05"]')
            first.type(f'runpy.run_path("{TTY_JOB}", run_name="__main__")\'')
            first.wait_for(re.compile(r"^count 5$", re.M))

            # The PID a person sees: the job's own process in `ps`.
            listing = second.output("ps -eo pid=,args= | grep -F 'import runpy'")
            (cmd,) = pids_in_ps(listing, "python3 -c import runpy")
            init = psutil.Process(cmd).ppid()
            job_pids += [init, cmd]
            assert ns_pid(cmd)[-1] == 2 and ns_pid(init)[-1] == 1  # CMD, under exec's init
            assert sorted(cg.procs()) == sorted([init, cmd])
            grown = cg.snapshot()
            assert grown.anon_bytes > 40 * MiB

            # attach PID with the PID from ps: the job's terminal, input included
            before = second.prompts()
            second.type(f"oomguard attach {cmd}")
            second.wait_for(re.compile(r"^count \d+$", re.M))
            second.type("from the second pane")
            second.wait_for(re.compile(r"^echo: from the second pane$", re.M))
            second.keys("C-\\")  # detach
            second.wait_for(re.compile(r"^oomguard: detached", re.M))
            second.wait_prompt(before + 1)

            # `oomguard checkpoint PID`, typed: the whole job is taken, and it says which
            said = second.output(f"oomguard checkpoint {cmd}")
            checkpoint_id = next(line for line in said if re.fullmatch(r"\d{8}-\d{6}-\d+-\w+",
                                                                         line))
            taken = next(line for line in said if line.startswith("oomguard: process"))
            assert taken.startswith(
                f"oomguard: process {cmd} is in the job of {init} (its PID namespace's init): "
                "checkpointed the whole job, 2 processes: python3 -c import runpy, sys\\n")
            assert len(taken) <= WIDTH and taken.endswith("\u2026") and "nsinit" not in taken
            assert wait_until(lambda: gone(init) and gone(cmd), 10)
            assert wait_until(lambda: not cg.procs(), 10)
            assert cg.snapshot().anon_bytes < 4 * MiB  # the job's memory is free
            done = guard.wait_event("checkpoint.done")[0]
            assert (done["id"], done["pid"], done["job_pid"]) == (checkpoint_id, init, cmd)
            assert done["job_command"].startswith("python3 -c import runpy, sys\nsys.argv = ")
            meta = Store(store).get(checkpoint_id)
            assert (meta.pid, meta.job_pid, meta.pidns) == (init, cmd, True)
            assert sorted(meta.pids) == sorted([init, cmd])
            first.wait_for(re.compile(rf"checkpointed as {checkpoint_id}", re.M))
            first.wait_prompt(2)  # exec returned
            assert first.output('echo "exit status $?"') == [
                f"exit status {EXIT_CHECKPOINTED}"]
            stopped_at = last_count(log)

            # list: the job's own command on one line, cut to the terminal's width; the PID
            # seen and the tree's root
            listed = second.output("oomguard list")
            assert listed[0].split() == ["ID", "PID", "ROOT", "USER", "RSS", "IMAGE", "STATE",
                                         "CREATED", "COMMAND"]
            (row,) = [line for line in listed if line.startswith(checkpoint_id)]
            assert row.split()[1:3] == [str(cmd), str(init)]
            assert "  python3 -c import runpy, sys\\nsys.argv = " in row
            assert row.endswith("\u2026") and len(row) <= WIDTH and "nsinit" not in row
            # show PID (the one from ps): the newest checkpoint whose tree held it
            shown = second.output(f"oomguard show {cmd}")
            assert f"id        {checkpoint_id}" in shown
            (command_row,) = [line for line in shown if line.startswith("command ")]
            assert command_row.startswith("command   python3 -c import runpy, sys\\nsys.argv")
            assert len(command_row) <= WIDTH and command_row.endswith("\u2026")
            assert (f"pid       {cmd} (the job's main process; its tree: {init}, its PID "
                    "namespace's init, 2 tasks)") in shown

            # status: the checkpoint among the last events, the job's command on its one line
            status = second.output("oomguard status")
            (event,) = [line for line in status if " checkpoint.done " in line]
            assert f"id={checkpoint_id} pid={init} job_pid={cmd} command=python3 -c import " \
                "runpy, sys\\nsys.argv" in event
            assert len(event) <= WIDTH and "nsinit" not in event and "\u2026\u2026" not in event

            # restore, typed in the job's first terminal: it comes back there and goes on
            first.type(f"oomguard restore {checkpoint_id}")
            assert wait_until(lambda: last_count(log) > stopped_at + 10, 60), \
                "\n".join(first.lines()[-20:])
            counts = read_counts(log)
            assert counts == list(range(1, len(counts) + 1)), "the count restarted or skipped"
            first.wait_for(re.compile(rf"^count {stopped_at + 10}$", re.M))
            restored = Store(store).get(checkpoint_id)
            assert restored.state == "restored" and restored.restored_pid
            job_pids.append(restored.restored_pid)
            first.keys("C-\\")  # detach from the restored job
            first.wait_for(re.compile(r"^oomguard: detached", re.M))

            # attach with CMD's new PID, read from ps again
            listing = second.output("ps -eo pid=,args= | grep -F 'import runpy'")
            (new_cmd,) = pids_in_ps(listing, "python3 -c import runpy")
            job_pids.append(new_cmd)
            assert psutil.Process(new_cmd).ppid() == restored.restored_pid
            # show PID with the new PID: the checkpoint the running job came back from
            shown = second.output(f"oomguard show {new_cmd}")
            assert f"id        {checkpoint_id}" in shown and "state     restored" in shown
            second.type(f"oomguard attach {new_cmd}")
            mark = last_count(log)
            second.wait_for(re.compile(rf"^count {mark + 3}$", re.M))
            second.type("after the restore")
            second.wait_for(re.compile(r"^echo: after the restore$", re.M))
            second.keys("C-\\")
            assert "input after the restore" in log.read_text()
            assert "input from the second pane" in log.read_text()
    finally:
        for pid in job_pids:
            kill_pid(pid)
        shell.close()


def test_a_system_rule_takes_the_whole_job_of_its_largest_process(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The largest process of the machine is CMD, inside an exec job: the rule checkpoints the
    job from its init (CRIU cannot dump CMD alone), and exec reports the checkpoint."""
    cg = cgroups.make("systemjob", None)
    floor = psutil.virtual_memory().available - 300 * MiB
    socket_path = tmp_path / "control.sock"
    config = tmp_path / "system.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{socket_path}"\n'
                      f'poll_interval = "50ms"\n\n[[guard]]\nsystem = true\n'
                      f'min_available = {floor}\nvictim_cgroups = ["{cg.path}"]\n')
    log = tmp_path / "hog.log"
    with daemon(store, tmp_path / "daemon.log", "--config", str(config),
                socket=socket_path) as guard:
        guard.wait_event("guard.armed")
        wrapper = subprocess.Popen(
            [*oomguard_argv(store), "--socket", str(socket_path), "exec", "--cgroup",
             str(cg.path), "--", *hog_argv(log, target=700, rate=200, count=100_000)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=tmp_path, start_new_session=True)
        try:
            assert wait_until(lambda: last_count(log) > 3, 30)
            (init,) = psutil.Process(wrapper.pid).children()
            (cmd,) = psutil.Process(init.pid).children()
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert wrapper.wait(timeout=30) == EXIT_CHECKPOINTED
        finally:
            kill_pid(wrapper.pid)
    assert (done["pid"], done["job_pid"]) == (init.pid, cmd.pid)
    assert done["job_command"].startswith(f"{sys.executable} ")
    assert not guard.events("checkpoint.failed")
    meta = Store(store).get(done["id"])
    assert meta.pidns and sorted(meta.pids) == sorted([init.pid, cmd.pid])
    assert gone(init.pid) and gone(cmd.pid)


def test_a_cgroup_rule_refuses_a_job_whose_init_is_outside_its_cgroup_before_stopping_it(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """CMD moved itself into the guarded cgroup; its init stayed out. CRIU could dump it only
    with its init: the checkpoint is refused with that reason, and the job was never stopped."""
    cg = cgroups.make("initout", 160 * MiB)
    log = tmp_path / "hog.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path), "--threshold",
                "50%", "--actions", "checkpoint") as guard:  # (no page-out after it)
        guard.wait_event("guard.armed")
        wrapper = subprocess.Popen(
            [*oomguard_argv(store), "exec", "--", "/bin/sh", "-c",
             'echo $$ > "$0" && exec "$@"', str(cg.path / "cgroup.procs"),
             *hog_argv(log, target=100, rate=200, count=100_000)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=tmp_path, start_new_session=True)
        try:
            assert wait_until(lambda: last_count(log) > 3, 30)
            (init,) = psutil.Process(wrapper.pid).children()
            (cmd,) = psutil.Process(init.pid).children()
            assert cg.procs() == [cmd.pid]
            comm = cmd.name()
            failed = guard.wait_event("checkpoint.failed", timeout=60)[0]
            counted = last_count(log)
            assert wait_until(lambda: last_count(log) > counted + 5, 10)  # still running
        finally:
            wrapper.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                wrapper.wait(timeout=10)
            kill_pid(wrapper.pid)
    assert failed["outcome"] == "untouched" and failed["pid"] == cmd.pid
    assert (f"process {cmd.pid} ({comm}) is inside a PID namespace (an `oomguard exec` job), "
            "which CRIU dumps only whole, from the namespace's init, and the init, process "
            f"{init.pid}, is outside the cgroup {cg.rel_path}") in failed["error"]
    assert not guard.events("victim.frozen") and not guard.events("checkpoint.done")


def test_a_user_may_not_checkpoint_a_job_whose_init_is_not_theirs(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Root started the job (its init is root's) and CMD runs as the user: the user's PID
    stands for the whole job, which is not all theirs, so it is refused before any stop."""
    cg = cgroups.make("rights", None)
    user = unprivileged_user("oomguard-t-mallory2", 40032)
    as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]
    logs = Path(tempfile.mkdtemp(prefix="ogr-", dir="/tmp"))  # pytest's tmp is root's alone
    logs.chmod(0o777)
    log = logs / "hog.log"
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    with daemon(store, tmp_path / "daemon.log", socket=sock) as guard:
        guard.wait_event("guard.started")
        assert wait_until(sock.exists, 10)
        wrapper = subprocess.Popen(
            [*oomguard_argv(store), "exec", "--cgroup", str(cg.path), "--", *as_user,
             *hog_argv(log, target=16, rate=100, count=100_000)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=tmp_path, start_new_session=True)
        try:
            assert wait_until(lambda: last_count(log) > 3, 30)
            (init,) = psutil.Process(wrapper.pid).children()
            (cmd,) = psutil.Process(init.pid).children()
            assert cmd.uids().real == user and init.uids().real == 0
            asked = subprocess.run(
                [*as_user, sys.executable, "-m", "oomguard", "--socket", str(sock),
                 "checkpoint", str(cmd.pid)], capture_output=True, text=True, cwd="/",
                timeout=60, stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"]})
            assert asked.returncode == 1
            assert (f"process {init.pid} (the init of the job of process {cmd.pid}) is not "
                    "yours") in asked.stderr
            counted = last_count(log)
            assert wait_until(lambda: last_count(log) > counted + 3, 10)  # never stopped
            assert proc_state(cmd.pid) in ("S", "R") and proc_state(init.pid) == "S"
            assert not guard.events("victim.frozen") and not guard.events("checkpoint.done")
        finally:
            wrapper.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                wrapper.wait(timeout=10)
            kill_pid(wrapper.pid)
            shutil.rmtree(logs, ignore_errors=True)
