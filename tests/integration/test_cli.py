"""The command line against a real store and the real CRIU: list/show/forget, permissions,
bad input (exit 2, naming the key and the file), the daemon on the embedded default config."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.model.errors import CgroupGone
from tests.helpers import (
    REPO,
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    oomguard_argv,
    parse_events,
    proc_state,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_list_show_forget_and_store_permissions(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("cli", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=32, rate=200, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 10, 10)
        result = run_oomguard(store, "checkpoint", str(hog.pid), "--reason", "test")
        assert result.returncode == 0, result.stderr
        checkpoint_id = result.stdout.strip()
    finally:
        hog.wait(timeout=10)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert stat.S_IMODE((store / checkpoint_id).stat().st_mode) == 0o700

    listed = run_oomguard(store, "list", "--json")
    assert listed.returncode == 0
    (entry,) = json.loads(listed.stdout)
    assert entry["id"] == checkpoint_id and entry["pid"] == hog.pid
    assert entry["reason"] == "test" and entry["state"] == "checkpointed"
    assert entry["user"] == "root" and entry["cgroup"] == cg.rel_path
    assert entry["image_bytes"] > 32 * MiB and entry["criu_version"].startswith("4.")
    assert "hog.py" in entry["command"]

    table = run_oomguard(store, "list")
    assert checkpoint_id in table.stdout and "checkpointed" in table.stdout
    shown = run_oomguard(store, "show", checkpoint_id, "--json")
    assert json.loads(shown.stdout)["pids"] == [hog.pid]

    assert run_oomguard(store, "forget", checkpoint_id).returncode == 0
    assert not (store / checkpoint_id).exists()
    again = run_oomguard(store, "show", checkpoint_id)
    assert again.returncode == 1 and "no checkpoint" in again.stderr
    bad = run_oomguard(store, "show", "../etc")
    assert bad.returncode == 1 and "invalid checkpoint id" in bad.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (["run", "--threshold", "150%"], "--threshold"),
    (["run", "--poll-interval", "soon"], "--poll-interval"),
    (["restore"], "id"),
    (["checkpoint", "abc"], "invalid int"),
    (["frobnicate"], "invalid choice"),
    (["run", "--cgroup", "relative/path"], "--cgroup"),
])
def test_bad_arguments_exit_2(store: Path, args: list[str], expected: str) -> None:
    result = run_oomguard(store, *args, timeout=30)
    assert result.returncode == 2, result
    assert expected in result.stderr


def test_bad_config_file_names_file_and_every_key(store: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\npoll_interval = "fast"\n\n[[guard]]\ncgroups = ["/x"]\n'
                   'threshold = "150%"\nfrobnicate = 1\n')
    for args in (["check-config", str(bad)], ["run", "--config", str(bad)]):
        result = run_oomguard(store, *args, timeout=30)
        assert result.returncode == 2
        for key in ("daemon.poll_interval", "guard[0].threshold", "guard[0].frobnicate"):
            assert f"{bad}: {key}:" in result.stderr, result.stderr
    good = run_oomguard(store, "check-config", "config/oomguard.toml")
    assert good.returncode == 0 and "OK" in good.stdout


def test_doctor_passes_on_this_machine(store: Path) -> None:
    result = run_oomguard(store, "doctor")
    assert result.returncode == 0, result.stdout
    for name in ("kernel", "cgroups", "criu", "criu check", "privileges"):
        assert f"PASS  {name}:" in result.stdout
    assert "Looks good" in result.stdout


def test_daemon_on_embedded_default_config_idles_and_stops_cleanly(
        store: Path, tmp_path: Path) -> None:
    daemon = DaemonProcess(store, tmp_path / "daemon.log")
    try:
        idle = daemon.wait_event("guard.idle", timeout=30)[0]
        assert "no [[guard]] rules" in idle["explanation"]
        started = daemon.events("guard.started")[0]
        assert started["config"] in ("<embedded default>", "/etc/oomguard/oomguard.toml")
        time.sleep(0.5)
        assert daemon.handle.poll() is None
        daemon.handle.send_signal(signal.SIGTERM)
        assert daemon.handle.wait(timeout=10) == 0
        assert daemon.events("guard.stopped")
    finally:
        daemon.stop()


def test_sigterm_is_handled_while_guarding(cgroups: CgroupFactory, store: Path,
                                           tmp_path: Path) -> None:
    cg = cgroups.make("term", 128 * MiB)
    daemon = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    try:
        daemon.wait_event("guard.armed")
        assert daemon.stop() == 0
    finally:
        daemon.stop()
    # The CRIU cgroup the daemon made beneath its own is gone again.
    assert not (cg.path.parent / f"oomguard-criu-{daemon.handle.pid}").exists()


def test_guarded_cgroup_removed_and_recreated(cgroups: CgroupFactory, store: Path,
                                              tmp_path: Path) -> None:
    """A cgroup that goes away is routine: the daemon says so, keeps running, and re-arms when
    it comes back."""
    cg = cgroups.make("comego", 128 * MiB)
    daemon = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    try:
        daemon.wait_event("guard.armed")
        cg.path.rmdir()
        daemon.wait_event("guard.cgroup_gone", timeout=10)
        assert daemon.handle.poll() is None
        cg.create()
        cg.set_limit(128 * MiB)
        daemon.wait_event("guard.armed", count=2, timeout=10)
        assert daemon.handle.poll() is None
    finally:
        assert daemon.stop() == 0


class _RemovedBetweenOpenAndRead:
    """A controller whose every read opens the cgroup's file, removes the cgroup, then reads:
    the race CI hit at start-up (cgroupspy had opened the file when the test's rmdir came)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getattr__(self, attribute: str) -> str:
        with open(self.path / f"memory.{attribute}") as control:
            self.path.rmdir()
            return control.read()


def test_a_cgroup_removed_between_open_and_read_is_gone_not_a_crash(
        cgroups: CgroupFactory) -> None:
    """The kernel answers ENODEV, not ENOENT, when a cgroup is removed after one of its files
    was opened. CI saw the daemon die of it while arming (an OSError out of the first
    snapshot); the layer must say CgroupGone, which the daemon handles as routine."""
    raw = cgroups.make("openread-raw", 64 * MiB)
    fd = os.open(raw.path / "memory.usage_in_bytes", os.O_RDONLY)
    try:
        raw.path.rmdir()
        with pytest.raises(OSError) as read_error:
            os.read(fd, 64)
        assert read_error.value.errno == errno.ENODEV
    finally:
        os.close(fd)

    cg = cgroups.make("openread", 64 * MiB)
    assert isinstance(cg, V1MemoryCgroup)
    cg._ctl = _RemovedBetweenOpenAndRead(cg.path)  # type: ignore[assignment]
    with pytest.raises(CgroupGone):
        cg.snapshot()
    assert not cg.path.exists()


def test_checkpoint_and_restore_show_progress_on_a_terminal(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """On a TTY (script(1) gives the CLI one) a checkpoint shows the bytes written and a
    restore the bytes brought back, against the checkpoint's size."""
    if shutil.which("script") is None:
        pytest.skip("script(1) missing")
    cg = cgroups.make("progress", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=400, rate=2000, count=100_000))
    assert wait_until(lambda: last_count(log) > 110, 20)
    command = " ".join(oomguard_argv(store, "checkpoint", str(hog.pid)))
    shown = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    assert shown.returncode == 0, shown.stdout
    lines = shown.stdout.replace("\r", "\n").splitlines()
    final = [line for line in lines if line.startswith(f"checkpoint of {hog.pid}:")][-1]
    assert "MiB in" in final
    hog.wait(timeout=10)
    checkpoint_id = lines[-1].strip()
    command = " ".join(oomguard_argv(store, "restore", checkpoint_id))
    shown = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    assert shown.returncode == 0, shown.stdout
    lines = shown.stdout.replace("\r", "\n").splitlines()
    final = [line for line in lines if line.startswith(f"restore of {checkpoint_id}:")][-1]
    assert "] 100% " in final and " of " in final and "MiB" in final  # it ends full
    said = re.fullmatch(rf"restored {checkpoint_id} as PID (\d+) \(was {hog.pid}\) "
                        rf"into {re.escape(cg.rel_path)}", lines[-1].strip())
    assert said, lines[-1]
    kill_pid(int(said.group(1)))


def test_job_whose_session_leader_is_outside_the_pid_namespace_is_refused_untouched(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A job started in a PID namespace without setsid (a sandbox, a CI runner): its session
    leader is outside, /proc shows session 0 and CRIU cannot dump it. The checkpoint is refused
    before the job is stopped, with the reason, and the job keeps running."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) missing")
    cg = cgroups.make("outside", None)
    log = tmp_path / "hog.log"
    script = ('"$@" & hog=$!\n'
              'while [ ! -s "$LOG" ]; do sleep 0.05; done\n'
              '$OOMGUARD checkpoint $hog > "$OUT" 2>&1; echo $? > "$RC"\n'
              'tail -n 1 "$LOG" > "$BEFORE"; sleep 1; tail -n 1 "$LOG" > "$AFTER"\n'
              'kill $hog; wait $hog; exit 0\n')
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LOG": str(log),
           "OOMGUARD": " ".join(oomguard_argv(store)), "OUT": str(tmp_path / "out"),
           "RC": str(tmp_path / "rc"), "BEFORE": str(tmp_path / "before"),
           "AFTER": str(tmp_path / "after")}
    # No setsid: the namespace's processes keep the test's session, whose leader is outside.
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", "-c", script,
            "sh", *hog_argv(log, target=32, rate=100, count=100_000)]
    full = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.path / "cgroup.procs"), *argv]
    done = subprocess.run(full, env=env, cwd=REPO, timeout=120, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    output = (tmp_path / "out").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", output
    assert "outside oomguard's PID namespace" in output and '"outcome": "untouched"' in output
    before = int((tmp_path / "before").read_text().split()[0])
    after = int((tmp_path / "after").read_text().split()[0])
    assert after > before  # it was never stopped and went on counting
    assert run_oomguard(store, "list").stdout.strip().count("\n") == 0  # only the heading


def test_a_shell_jobs_process_group_leader_survives_its_restore(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A job started by a shell with job control leads its own process group but not its
    session. Dumped stopped, it is restored stopped, in CRIU's session (--shell-job); when
    CRIU exits, the kernel sends an orphaned, stopped process group SIGHUP — unless the
    restore's post-resume action has continued it first (found in the Slurm lane)."""
    cg = cgroups.make("pgrp", None)
    log = tmp_path / "hog.log"
    pidfile = tmp_path / "hog.pid"
    # The shell stays (as a login shell does): were it to exit while the job is stopped for
    # its dump, the kernel would hang up the then orphaned group.
    script = 'set -m; "$@" & echo $! > "$0"; while :; do sleep 0.2; done'
    shell = start_in_cgroup(cg, ["/bin/bash", "-c", script, str(pidfile),
                                 *hog_argv(log, target=32, rate=100, count=100_000)])
    restored = None
    try:
        assert wait_until(lambda: pidfile.exists() and last_count(log) > 10, 10)
        pid = int(pidfile.read_text())
        assert os.getpgid(pid) == pid and os.getsid(pid) != pid  # group leader, not session
        done = run_oomguard(store, "checkpoint", str(pid))
        assert done.returncode == 0, done.stderr
        mark = last_count(log)
        target = cgroups.make("pgrpback", None)
        back = run_oomguard(store, "restore", done.stdout.strip(), "--cgroup", str(target.path))
        assert back.returncode == 0, back.stderr
        restored = int(back.stdout.strip())
        assert wait_until(lambda: last_count(log) > mark + 10, 10), "the restored job died"
        assert proc_state(restored) not in (None, "Z", "T")
    finally:
        for victim in (restored, shell.pid):
            if victim:
                kill_pid(victim)
        shell.wait(timeout=10)


def test_ids_by_prefix_or_last_show_for_people_and_the_restored_line(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Two real checkpoints: an id may be given by a unique prefix or as `last`; a prefix both
    begin is refused (exit 2) naming both; `show` is for people unless --json; `restore` says
    what it restored, as what and where (stderr when stdout is not a terminal: stdout keeps
    the PID for scripts)."""
    cg = cgroups.make("people", None)
    hogs, ids, restored = [], [], []
    try:
        for n in range(2):
            log = tmp_path / f"hog{n}.log"
            hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=100, count=100_000))
            hogs.append(hog)
            assert wait_until(lambda log=log: last_count(log) > 10, 10)
            done = run_oomguard(store, "checkpoint", str(hog.pid))
            assert done.returncode == 0, done.stderr
            hog.wait(timeout=10)
            ids.append(done.stdout.strip())
            (event,) = [e for e in parse_events(done.stderr) if e["event"] == "checkpoint.done"]
            assert event["restore"] == f"oomguard restore {ids[-1]}"
        first, newest = ids
        differ = next(i for i, (a, b) in enumerate(zip(first, newest, strict=False)) if a != b)
        common = first[:differ]  # both begin with it: at least the year
        assert common

        for verb in ("show", "restore", "forget"):
            refused = run_oomguard(store, verb, common)
            assert refused.returncode == 2, refused.stderr
            assert f"checkpoint id '{common}' is ambiguous" in refused.stderr
            assert first in refused.stderr and newest in refused.stderr
        assert run_oomguard(store, "show", "nosuch").returncode == 1

        human = run_oomguard(store, "show", "last")
        assert human.returncode == 0, human.stderr
        rows = human.stdout.splitlines()
        assert rows[0] == f"id        {newest}" and rows[1] == "state     checkpointed"
        assert f"pid       {hogs[1].pid}" in rows and f"cgroup    {cg.rel_path} (cgroup v1)" in rows
        assert re.search(r"^resident  \d+\.\dMiB$", human.stdout, re.MULTILINE), human.stdout
        assert rows[-1] == f"restore   oomguard restore {newest}"
        machine = run_oomguard(store, "show", first[:len(common) + 1], "--json")
        assert machine.returncode == 0, machine.stderr
        assert json.loads(machine.stdout)["id"] == first

        for text, checkpoint_id, hog in (("last", newest, hogs[1]),
                                         (first[:len(common) + 1], first, hogs[0])):
            back = run_oomguard(store, "restore", text)
            assert back.returncode == 0, back.stderr
            pid = int(back.stdout.strip())
            restored.append(pid)
            assert f"restored {checkpoint_id} as PID {pid} (was {hog.pid}) into {cg.rel_path}" \
                in back.stderr.splitlines()
            (event,) = [e for e in parse_events(back.stderr) if e["event"] == "restore.done"]
            assert event["id"] == checkpoint_id and event["pid"] == pid
        shown = json.loads(run_oomguard(store, "show", "last", "--json").stdout)
        assert shown["state"] == "restored" and shown["restored_pid"] == restored[0]
    finally:
        for pid in restored:
            kill_pid(pid)
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
                hog.wait(timeout=10)
