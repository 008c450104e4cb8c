"""Jobs typed at a plain shell prompt, no `oomguard exec` (issue 25, item 1): in a real terminal
(tmux, an interactive bash), the job moves itself into a guarded cgroup as cgexec would, is
checkpointed by a real daemon at the threshold, and `oomguard restore` typed at a prompt brings
it back onto a new terminal held by oomguard, where it goes on from where it was; `attach` finds
it from anywhere; what CRIU could not restore is refused before the job is stopped."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.store.checkpoints import Store
from oomguard.terminal.shelljob import SHELL_TTY
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    kill_pid,
    run_cli,
    short_socket_path,
    wait_until,
)
from tests.integration.test_service import ALICE, _cap_sys_resource
from tests.terminals import pids_running, stop_and_continue, tmux_shell, wait_gone

pytestmark = pytest.mark.integration
TTY_JOB = REPO / "tests" / "workloads" / "tty_job.py"


def job_command(log: Path, cgroup: Path, *, target: int = 160, count: int = 300,
                redirect: str = "") -> str:
    """What a person types: the job joins the cgroup (as cgexec does) and runs."""
    return (f"sh -c 'echo $$ > {cgroup}/cgroup.procs && exec {sys.executable} {TTY_JOB} "
            f"--log {log} --target {target} --rate 60 --count {count} --tick 0.05'{redirect}")


def counts(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().splitlines() if line.isdigit()]


def done_line(log: Path) -> str | None:
    return next((x for x in log.read_text().splitlines() if x.startswith("done")), None)


def write_config(path: Path, store: Path, socket: Path, *cgroups: Path,
                 actions: str = '["checkpoint"]') -> Path:
    names = ", ".join(f'"{c}"' for c in cgroups)
    path.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{socket}"\n\n'
                    f'[[guard]]\ncgroups = [{names}]\nthreshold = "85%"\n'
                    f"actions = {actions}\n")
    return path


@pytest.fixture
def setup(cgroups: CgroupFactory, store: Path, tmp_path: Path) -> Iterator[dict[str, Path]]:
    small = cgroups.make("shell", 128 * MiB)
    mid = cgroups.make("shellmid", 256 * MiB)
    big = cgroups.make("shellbig", 512 * MiB)
    socket = Path("/tmp") / f"ogsh-{tmp_path.name[-12:]}.sock"
    config = write_config(tmp_path / "oomguard.toml", store, socket, small.path, mid.path)
    yield {"small": small.path, "mid": mid.path, "big": big.path, "config": config,
           "socket": socket, "store": store, "log": tmp_path / "job.log", "dir": tmp_path}
    for pid in pids_running(str(tmp_path / "job.log")):
        kill_pid(pid)


def shell_env(config: Path) -> dict[str, str]:
    return {**os.environ, "OOMGUARD_CONFIG": str(config)}


def test_a_job_typed_at_a_prompt_is_restored_onto_a_new_terminal_and_goes_on(
        setup: dict[str, Path]) -> None:
    """Typed at a prompt, checkpointed in its 128 MiB cgroup; restored from the same prompt
    into a guarded 256 MiB cgroup, where it outgrows the threshold again and is checkpointed
    from its new terminal (the attached restore says so); restored again into 512 MiB, it
    runs to its end."""
    log = setup["log"]
    with daemon(setup["store"], setup["dir"] / "daemon.log", config=setup["config"],
                socket=setup["socket"]) as guard, \
            tmux_shell("typed", setup["dir"], shell_env(setup["config"])) as shell:
        guard.wait_event("guard.armed", count=2)
        shell.type(job_command(log, setup["small"], target=240, count=400))
        shell.wait_for("count 3")
        shell.type("before")  # the job reads its terminal: the shell's, for now
        shell.wait_for("echo: before")
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        job_pid = int(done["pid"])
        assert wait_gone(job_pid), "the dumped job is still there"
        meta = Store(setup["store"]).get(done["id"])
        # The terminal it was typed at is recorded, and the prompt says how to bring it back.
        assert meta.extra[SHELL_TTY]["index"] == int(shell.tty().rsplit("/", 1)[1])
        shell.wait_for(f"was checkpointed as {done['id']}")
        shell.wait_prompt(2)  # the shell is back at its prompt (the job was killed by CRIU)
        before = counts(log)
        assert before == list(range(1, len(before) + 1))
        usage = (setup["small"] / "memory.usage_in_bytes").read_text()
        assert int(usage) < 32 * MiB, "the job's memory was not freed"

        # The same prompt: restore it (through the daemon). It comes back on a new terminal,
        # shown here, and goes on counting from where it was, until it outgrows this cgroup.
        since = shell.mark()
        shell.type(f"oomguard restore {done['id']} --cgroup {setup['mid']}")
        shell.wait_for(re.compile(rf"restored {done['id']} as PID \d+"), since=since)
        shell.wait_for(f"count {before[-1] + 3}", since=since)
        shell.type("after")  # a line typed here reaches the restored job
        shell.wait_for("echo: after", since=since)
        again = guard.wait_event("checkpoint.done", timeout=60, count=2)[1]
        assert again["pid"] == job_pid
        shell.wait_for(f"the job was checkpointed as {again['id']}", since=since)
        assert "status 75" in shell.run('echo "status $?"')
        assert Store(setup["store"]).get(again["id"]).extra[SHELL_TTY]["socket"] is not None

        since = shell.mark()
        shell.type(f"oomguard restore {again['id']} --cgroup {setup['big']}")
        shell.wait_for("the job exited with status 0", timeout=60, since=since)
        assert "status 0" in shell.run('echo "status $?"')  # restore ended with the job
    assert done_line(log) == "done 400 ok"
    assert counts(log) == list(range(1, 401)), "the count restarted or skipped"
    text = log.read_text()
    assert "input before" in text and "input after" in text
    assert text.count("start tty=1") == 1  # one process all along
    assert len(guard.events("checkpoint.failed")) == 0


def test_restored_from_no_terminal_then_attached_stopped_and_continued(
        setup: dict[str, Path]) -> None:
    """The daemon restores (asked from no terminal); `attach ID` typed at a prompt shows the
    job; Ctrl-Z stops it and the shell gets the prompt back; `fg` continues it; the attach
    ends with the job. A checkpoint taken before meta.json recorded the terminal restores
    too (found in its images)."""
    log = setup["log"]
    with daemon(setup["store"], setup["dir"] / "daemon.log", config=setup["config"],
                socket=setup["socket"]) as guard, \
            tmux_shell("first", setup["dir"], shell_env(setup["config"])) as first:
        guard.wait_event("guard.armed")
        first.type(job_command(log, setup["small"], count=400))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        first.wait_prompt(2)
        store = Store(setup["store"])
        meta = store.get(done["id"])
        del meta.extra[SHELL_TTY]  # as a checkpoint of an older oomguard
        store.update(meta)
        result = run_cli("--config", str(setup["config"]), "restore", done["id"], "--cgroup",
                         str(setup["big"]), env=shell_env(setup["config"]))
        assert result.returncode == 0, result.stderr
        pid = int(result.stdout.strip())
        assert guard.wait_event("restore.done")
        holder = Store(setup["store"]).get(done["id"]).extra[SHELL_TTY]["socket"]
        assert holder and Path(holder).exists()
        with tmux_shell("viewer", setup["dir"], shell_env(setup["config"])) as viewer:
            seen = len(counts(log))
            viewer.type(f"oomguard attach {done['id']}")
            viewer.wait_for(f"count {seen + 3}")
            stopped_at = stop_and_continue(viewer, pid, lambda: len(counts(log)))
            viewer.wait_for(f"count {stopped_at + 3}")
            viewer.wait_for("the job exited with status 0", timeout=90)
            assert "status 0" in viewer.run('echo "status $?"')
    assert done_line(log) == "done 400 ok"
    assert counts(log) == list(range(1, 401))


def test_a_restore_whose_daemon_is_killed_halfway_leaves_the_checkpoint_whole(
        setup: dict[str, Path]) -> None:
    """The daemon restoring a job typed at a prompt is SIGKILLed while CRIU restores it: the
    pages' verdict never comes, so the restored tree is killed before it runs (never a job
    running twice, nor one left stopped), the new terminal's leader ends with it, and the
    checkpoint stays whole: the next daemon restores it, and the job runs to its end."""
    log = setup["log"]
    with daemon(setup["store"], setup["dir"] / "daemon.log", config=setup["config"],
                socket=setup["socket"]) as guard, \
            tmux_shell("killed", setup["dir"], shell_env(setup["config"])) as shell:
        guard.wait_event("guard.armed", count=2)
        shell.type(job_command(log, setup["small"], count=400))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        shell.wait_prompt(2)
        work = Path(setup["store"]) / done["id"]
        restore = subprocess.Popen(
            [sys.executable, "-m", "oomguard", "--config", str(setup["config"]), "restore",
             done["id"], "--cgroup", str(setup["big"])], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_until(lambda: (work / "restore.log").exists(), 30), "CRIU never began"
            guard.handle.kill()  # halfway: CRIU restores, the daemon is gone
            guard.handle.wait()
            assert restore.wait(timeout=60) != 0
        finally:
            if restore.poll() is None:
                restore.kill()
        assert wait_until(lambda: not pids_running(str(log)), 30), "the job runs twice"
        assert Store(setup["store"]).get(done["id"]).state == "checkpointed"
        assert wait_until(lambda: not pids_running(f"--pidfile {work}"), 30), \
            "the leader of a restore that failed is still there"
    with daemon(setup["store"], setup["dir"] / "daemon2.log", config=setup["config"],
                socket=setup["socket"]) as guard, \
            tmux_shell("again", setup["dir"], shell_env(setup["config"])) as shell:
        guard.wait_event("guard.armed", count=2)
        shell.type(f"oomguard restore {done['id']} --cgroup {setup['big']}")
        shell.wait_for("the job exited with status 0", timeout=90)
    assert done_line(log) == "done 400 ok"
    assert counts(log) == list(range(1, 401))


def test_a_tree_criu_could_not_restore_is_refused_before_it_is_stopped(
        setup: dict[str, Path]) -> None:
    """A job holding the terminals of two sessions led outside it (its stderr sent to another
    window): CRIU restores one. The checkpoint step is refused before the job is stopped,
    with the reason, and the chain's next action (kill) runs, once."""
    config = write_config(setup["dir"] / "kill.toml", setup["store"], setup["socket"],
                          setup["small"], actions='["checkpoint", "kill"]')
    log = setup["log"]
    with daemon(setup["store"], setup["dir"] / "daemon.log", config=config,
                socket=setup["socket"]) as guard, \
            tmux_shell("two", setup["dir"], shell_env(config)) as shell, \
            tmux_shell("other", setup["dir"], shell_env(config)) as other:
        guard.wait_event("guard.armed")
        shell.type(job_command(log, setup["small"], redirect=f" 2>{other.tty()}"))
        refused = guard.wait_event("checkpoint.refused", timeout=60)[0]
        assert "2 terminals of sessions led outside it" in refused["reason"], refused
        assert refused["lasting"] is True and refused["then"] == "kill", refused
        assert not guard.events("victim.frozen"), "the job was stopped before the refusal"
        killed = guard.wait_event("victim.killed", timeout=30)[0]
        assert killed["pid"] == refused["pid"]
        assert killed["not_checkpointed"] == refused["reason"]
        shell.wait_prompt(2)
    assert len(guard.events("checkpoint.refused")) == 1
    assert not guard.events("checkpoint.failed")
    assert not list(Path(setup["store"]).glob("2*")), "a checkpoint was taken anyway"


@pytest.mark.skipif(not _cap_sys_resource(),
                    reason="root here lacks CAP_SYS_RESOURCE, so CRIU cannot dump another "
                           "user's process; this test runs in the v2 VM lane, where root has it")
def test_a_users_job_typed_at_a_prompt_comes_back_on_a_terminal_of_theirs(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """A user types a job at their own prompt; an admin puts it into a guarded cgroup; the
    root daemon checkpoints it. The user restores it from the same prompt through the daemon:
    its new terminal's holder, which led the restore as root, runs as the user, listens in the
    user's own directory, and the job goes on there."""
    uid = ALICE
    workdir = Path(tempfile.mkdtemp(prefix="og-shell-", dir="/tmp"))
    workdir.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    small = cgroups.make("usershell", 128 * MiB)
    socket = short_socket_path()
    socket.parent.chmod(0o755)
    config = write_config(workdir / "oomguard.toml", store, socket, small.path)
    config.chmod(0o644)
    log = workdir / "job.log"
    env = {"PATH": os.environ["PATH"], "OOMGUARD_CONFIG": str(config), "HOME": str(workdir)}
    with daemon(store, tmp_path / "daemon.log", config=config, socket=socket) as guard, \
            tmux_shell("user", workdir, env, user=uid) as shell:
        guard.wait_event("guard.armed")
        shell.type(f"{sys.executable} {TTY_JOB} --log {log} --target 160 --rate 60 "
                   "--count 300 --tick 0.05")
        shell.wait_for("count 3")
        (job,) = [p for p in pids_running(str(log)) if Path(f"/proc/{p}").stat().st_uid == uid]
        (small.path / "cgroup.procs").write_text(str(job))  # an admin's cgexec -g, say
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == job and done["uid"] == uid
        assert wait_gone(job)
        shell.wait_for(f"was checkpointed as {done['id']}")
        small.set_limit(512 * MiB)  # room for it again; the guard follows the new limit
        assert wait_until(lambda: any(e.get("limit") == 512 * MiB
                                      for e in guard.events("guard.armed")), 60)
        since = shell.mark()
        shell.type(f"oomguard restore {done['id']}")
        shell.wait_for(re.compile(rf"restored {done['id']} as PID \d+"), since=since)
        holder = Path(str(Store(store).get(done["id"]).extra[SHELL_TTY]["socket"]))
        assert holder.parent == Path("/run/oomguard/tty") / str(uid)
        assert holder.stat().st_uid == uid and holder.parent.stat().st_uid == uid
        leader = int(request_info(holder)["pid"])
        assert _uids(leader) == {uid}, "the terminal's holder kept root's rights"
        seen = counts(log)
        shell.wait_for(f"count {seen[-1] + 2}", since=since)  # shown here: attached
        shell.type("after")  # typed for the job once it shows (a line typed before is the shell's)
        shell.wait_for("echo: after", since=since)
        shell.wait_for("the job exited with status 0", timeout=90, since=since)
    assert counts(log) == list(range(1, 301))
    assert "input after" in log.read_text()


def request_info(socket: Path) -> dict[str, object]:
    from oomguard.terminal.client import request

    return request(socket, "info")


def _uids(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(v) for v in line.split()[1:]}
    return set()
