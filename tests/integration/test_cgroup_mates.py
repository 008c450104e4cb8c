"""Several jobs in one cgroup (issue 25, item 7): two growing jobs share a guarded cgroup, one of
them also writing a file through write(2) (page cache: on cgroup v1 with oom_kill_disable, a
charge made inside a system call at the limit fails with ENOMEM instead of waiting). While the
first is dumped the other is held stopped, so the room lifted for the dump is the victim's alone
and nothing of the cgroup reaches its limit (the kernel's memory.failcnt stays 0); a daemon
SIGKILLed in the middle of that loses nothing either. No job gets ENOMEM or is OOM-killed:
each finishes, or is checkpointed and restores and finishes. Real cgroups, CRIU, daemon."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.store.checkpoints import Store
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import FROZEN_LEDGER
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
LIMIT = 256 * MiB  # acting at 85%: 217.6 MiB


def _v1(cgroup: MemoryCgroup) -> V1MemoryCgroup:
    if not isinstance(cgroup, V1MemoryCgroup):
        pytest.skip("cgroup v1: write(2) at the limit fails only where oom_kill_disable parks")
    return cgroup


def _failcnt(cgroup: V1MemoryCgroup) -> int:
    """Times a charge found the cgroup at its limit (the kernel's count)."""
    return int((cgroup.path / "memory.failcnt").read_text())


def _done(log: Path) -> bool:
    return log.exists() and any(line.startswith("done ") and line.endswith(" ok")
                                for line in log.read_text().splitlines())


class Jobs:
    """The victim-to-be (V: the larger, not writing) and the writer (W: grows at 1000 MB/s
    and appends to a file through write(2) at every step), in one cgroup."""

    def __init__(self, cgroup: V1MemoryCgroup, tmp_path: Path) -> None:
        self.cgroup = cgroup
        self.tmp = tmp_path
        self.v_log, self.w_log = tmp_path / "v.log", tmp_path / "w.log"
        self.v = start_in_cgroup(cgroup, hog_argv(self.v_log, target=180, rate=300,
                                                  count=400, tick=0.01),
                                 log=tmp_path / "v.err", cwd=tmp_path)
        self.w: subprocess.Popen[bytes] | None = None

    def start_writer(self) -> None:
        """W starts once V holds its 180 MiB: it crosses the threshold while growing, and V,
        the larger, is the victim."""
        assert wait_until(lambda: last_count(self.v_log) >= 45, 60), "V never grew"
        self.w = start_in_cgroup(self.cgroup, [
            *hog_argv(self.w_log, target=130, rate=1000, count=400, tick=0.01),
            "--write", str(self.tmp / "w.dat"), "--write-kib", "512", "--write-max", "16"],
            log=self.tmp / "w.err", cwd=self.tmp)

    def writer_result(self) -> int | None:
        assert self.w is not None
        return self.w.poll()

    def kill(self) -> None:
        for proc in (self.v, self.w):
            if proc is not None:
                kill_pid(proc.pid)


def _restore_and_finish(store: Path, checkpoint_id: str, cgroups: CgroupFactory,
                        log: Path, name: str = "matesbig") -> None:
    before = last_count(log)
    big = cgroups.make(name, 768 * MiB)
    result = run_oomguard(store, "restore", checkpoint_id, "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: _done(log), 60), (log.read_text()[-300:], proc_state(pid))
        counts = [int(x.split()[0]) for x in log.read_text().splitlines() if x[0].isdigit()]
        assert counts == list(range(1, counts[-1] + 1)) and before > 0  # went on from there
        assert big.snapshot().oom_kills == 0
    finally:
        kill_pid(pid)


def _losses(jobs: Jobs, events: list[dict[str, Any]]) -> None:
    """No ENOMEM (the writer's exit status is the errno of a failed call), no OOM kill."""
    err = (jobs.tmp / "w.err").read_text() if (jobs.tmp / "w.err").exists() else ""
    assert jobs.writer_result() != errno.ENOMEM and "ENOMEM" not in err, err
    assert jobs.cgroup.snapshot().oom_kills == 0
    assert not [e for e in events if e.get("event") in ("oom.kill_seen", "oom.released")]


def test_two_growers_one_writing_lose_nothing_while_one_is_dumped(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = _v1(cgroups.make("mates", LIMIT))
    guard = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    jobs = Jobs(cg, tmp_path)
    try:
        guard.wait_event("guard.ready")
        jobs.start_writer()
        assert jobs.w is not None
        frozen = guard.wait_event("victim.frozen", timeout=60)[0]
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        # The victim is the larger job; the writer was held stopped while it was dumped...
        assert frozen["pid"] == done["pid"] == jobs.v.pid, guard.log.read_text()[-3000:]
        assert frozen["others_held"] == [jobs.w.pid]
        # ...so nothing of the cgroup ever reached its limit: not even the lifted one.
        assert _failcnt(cg) == 0
        assert jobs.v.wait(timeout=30) == -signal.SIGKILL  # CRIU's kill after the dump
        # The writer, continued, grows to its target and finishes: it alone stays below.
        assert wait_until(lambda: jobs.writer_result() is not None, 60), jobs.w_log.read_text()
        assert jobs.writer_result() == 0 and _done(jobs.w_log)
        assert len(guard.events("checkpoint.done")) == 1
        _losses(jobs, guard.events())
        assert cg.limit() == LIMIT
        assert json.loads((store / FROZEN_LEDGER).read_text() or "[]") == []
    finally:
        guard.stop()
        jobs.kill()
    _restore_and_finish(store, done["id"], cgroups, jobs.v_log)


def test_a_daemon_killed_while_it_holds_a_writer_loses_no_job(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """SIGKILL right after the victim is stopped and the writer held (mid-dump, as a rule:
    the dump takes a few hundred ms), then a new daemon at once: the dead daemon's CRIU
    finishes the dump (recovered at the start) or gave up and the victim is handled again;
    the writer is continued once that dump is over; no ENOMEM, no OOM kill, no task left
    stopped, and every job finishes or is checkpointed, restores and finishes."""
    cg = _v1(cgroups.make("matescrash", LIMIT))
    first = DaemonProcess(store, tmp_path / "first.log", "--cgroup", str(cg.path))
    second: DaemonProcess | None = None
    jobs = Jobs(cg, tmp_path)
    try:
        first.wait_event("guard.ready")
        jobs.start_writer()
        assert jobs.w is not None
        frozen = first.wait_event("victim.frozen", timeout=60)[0]
        first.handle.send_signal(signal.SIGKILL)
        first.handle.wait()
        assert frozen["others_held"] == [jobs.w.pid], first.log.read_text()[-3000:]
        second = DaemonProcess(store, tmp_path / "second.log", "--cgroup", str(cg.path),
                               socket=first.socket)
        second.wait_event("guard.ready", timeout=60)
        # The victim ends dumped (by the dead daemon's CRIU or the new daemon); the writer
        # runs on to its end.
        assert wait_until(lambda: jobs.v.poll() is not None, 60), proc_state(jobs.v.pid)
        assert jobs.v.returncode == -signal.SIGKILL
        assert wait_until(lambda: jobs.writer_result() is not None, 60), (
            proc_state(jobs.w.pid), jobs.w_log.read_text()[-200:])
        events = first.events() + second.events()
        # Or checkpointed in turn: continued while the dead daemon's dump of the victim was
        # still under way, the writer, the victim's memory not yet back, crosses the threshold
        # again and is the new daemon's victim (seen once in a full suite's run).
        w_done = [e for e in events if e.get("event") == "checkpoint.done"
                  and e.get("pid") == jobs.w.pid]
        if not w_done:
            assert jobs.writer_result() == 0 and _done(jobs.w_log), (
                jobs.writer_result(), cg.snapshot().oom_kills, first.log.read_text()[-4000:],
                second.log.read_text()[-6000:])
        else:
            assert jobs.writer_result() == -signal.SIGKILL  # CRIU's, after its dump
        _losses(jobs, events)
        checkpoints = [m for m in Store(store).list() if m.pid == jobs.v.pid]
        assert len(checkpoints) == 1 and checkpoints[0].state == "checkpointed", events
        assert [m.id for m in Store(store).list() if m.pid == jobs.w.pid] == \
            [e["id"] for e in w_done]
        assert wait_until(lambda: cg.limit() == LIMIT, 30), "the lifted limit stayed lifted"
        assert wait_until(lambda: not FrozenLedger(store / FROZEN_LEDGER).pending()
                          and json.loads((store / FROZEN_LEDGER).read_text() or "[]") == [],
                          30)
    finally:
        if second is not None:
            second.stop()
        first.stop()
        jobs.kill()
    _restore_and_finish(store, checkpoints[0].id, cgroups, jobs.v_log)
    for done in w_done:
        _restore_and_finish(store, done["id"], cgroups, jobs.w_log, "matesbigw")


def test_jobs_that_cross_while_no_daemon_runs_wait_for_the_next_one(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The daemon SIGKILLed while two jobs grow below the threshold, one of them writing; they
    cross it while no daemon runs, for as long as it takes: its standby stops them before the
    limit (memory.failcnt stays 0: no write(2) can fail there), and the next start takes over:
    the larger is checkpointed while the writer stays stopped (continued all at once, both
    caught up on the time they had been stopped and the writer's write(2) met the limit before
    the new daemon had stopped the victim), then the writer is continued. No ENOMEM, no OOM
    kill, nothing ever at the limit."""
    cg = _v1(cgroups.make("matesgap", LIMIT))
    first = DaemonProcess(store, tmp_path / "first.log", "--cgroup", str(cg.path))
    second: DaemonProcess | None = None
    v_log, w_log = tmp_path / "v.log", tmp_path / "w.log"
    v = w = None
    try:
        first.wait_event("guard.ready")
        v = start_in_cgroup(cg, hog_argv(v_log, target=180, rate=100, count=300, tick=0.01),
                            log=tmp_path / "v.err", cwd=tmp_path)
        w = start_in_cgroup(cg, [*hog_argv(w_log, target=120, rate=60, count=300, tick=0.01),
                                 "--write", str(tmp_path / "w.dat"), "--write-kib", "512",
                                 "--write-max", "16"], log=tmp_path / "w.err", cwd=tmp_path)
        assert wait_until(lambda: last_count(v_log) >= 10, 30)  # growing, below the threshold
        assert not first.events("threshold.crossed")
        first.handle.send_signal(signal.SIGKILL)
        first.handle.wait()
        held = first.wait_event("standby.held", timeout=60)[0]  # the standby's line, same log
        assert sorted(held["pids"]) == sorted([v.pid, w.pid])
        # Signalled, stopped once each is scheduled (on a busy machine a runnable task reads R
        # for a while after its SIGSTOP).
        assert wait_until(lambda: proc_state(v.pid) == "T" and proc_state(w.pid) == "T", 10), \
            (proc_state(v.pid), proc_state(w.pid))
        assert _failcnt(cg) == 0 and cg.snapshot().usage_bytes < LIMIT
        second = DaemonProcess(store, tmp_path / "second.log", "--cgroup", str(cg.path),
                               socket=first.socket)
        second.wait_event("standby.taken_over", timeout=60)
        done = second.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == v.pid
        thawed = second.wait_event("victim.thawed_after_crash")[0]  # once V's dump has ended
        assert thawed["thawed"] == [str(w.pid)]
        assert wait_until(lambda: w.poll() is not None, 60), (proc_state(w.pid),
                                                              w_log.read_text()[-200:])
        assert w.returncode == 0 and _done(w_log)
        assert v.wait(timeout=30) == -signal.SIGKILL
        assert _failcnt(cg) == 0
        err = (tmp_path / "w.err").read_text()
        assert "ENOMEM" not in err and cg.snapshot().oom_kills == 0, err
        assert not [e for e in first.events() + second.events()
                    if e.get("event") in ("oom.kill_seen", "oom.released", "standby.gave_up")]
    finally:
        if second is not None:
            second.stop()
        first.stop()
        for proc in (v, w):
            if proc is not None:
                kill_pid(proc.pid)
    _restore_and_finish(store, done["id"], cgroups, v_log)


def test_a_job_the_standby_held_runs_on_when_the_next_daemon_cannot_dump_it(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Found by the soak drill: a job crossed while no daemon ran and its standby stopped it;
    the next daemon's checkpoint was refused (the store over its budget), and the job stayed
    stopped, its ledger entry gone with the refused action's, so the next checkpoint took the
    stop for its user's, and the restored job came back stopped, for good. Now the refused
    action ends with the job continued (victim.thawed_after_crash); given room (a reload with
    a budget), its checkpoint holds no task the user stopped, and the restored job finishes."""
    cg = _v1(cgroups.make("mateshold", LIMIT))
    config = tmp_path / "oomguard.toml"

    def budget(cap: str) -> None:
        config.write_text(f'[daemon]\nstore_max_size = "{cap}"\n\n[[guard]]\ncgroups = ["{cg.path}"]\n')

    budget("90%")
    first = DaemonProcess(store, tmp_path / "first.log", "--config", str(config))
    second: DaemonProcess | None = None
    v_log = tmp_path / "v.log"
    v = None
    try:
        first.wait_event("guard.ready")
        v = start_in_cgroup(cg, hog_argv(v_log, target=240, rate=40, count=100_000, tick=0.01),
                            log=tmp_path / "v.err", cwd=tmp_path)
        assert wait_until(lambda: last_count(v_log) >= 10, 30)
        assert not first.events("threshold.crossed")
        first.handle.send_signal(signal.SIGKILL)
        first.handle.wait()
        held = first.wait_event("standby.held", timeout=60)[0]
        assert held["pids"] == [v.pid]
        assert wait_until(lambda: proc_state(v.pid) == "T", 10), proc_state(v.pid)
        budget("1M")  # the next daemon's store has no room for it
        second = DaemonProcess(store, tmp_path / "second.log", "--config", str(config),
                               socket=first.socket)
        refused = second.wait_event("checkpoint.refused", timeout=60)[0]
        assert refused["pid"] == v.pid, refused
        thawed = second.wait_event("victim.thawed_after_crash", timeout=30)[0]
        assert thawed["thawed"] == [str(v.pid)], thawed
        counted = last_count(v_log)
        assert wait_until(lambda: last_count(v_log) > counted + 20, 30), proc_state(v.pid)
        budget("90%")
        second.handle.send_signal(signal.SIGHUP)
        done = second.wait_event("checkpoint.done", timeout=60)[0]
        assert done["pid"] == v.pid
        meta = Store(store).get(done["id"])
        assert meta.stopped_nspids == [], meta.stopped_nspids  # no stop of its user's
        assert v.wait(timeout=30) == -signal.SIGKILL
        assert cg.snapshot().oom_kills == 0
    finally:
        if second is not None:
            second.stop()
        first.stop()
        if v is not None:
            kill_pid(v.pid)
    # Restored, it runs (it came back stopped for good before): it counts on from there.
    big = cgroups.make("matesheldbig", 768 * MiB)
    before = last_count(v_log)
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: last_count(v_log) > before + 20, 30), proc_state(pid)
        counts = read_counts(v_log)
        assert counts == list(range(1, counts[-1] + 1))
    finally:
        kill_pid(pid)


class Tmux:
    """A terminal a person types into: tmux on a private socket, a bash in its one pane;
    keys are sent, the screen is read (capture-pane). The server is killed at close()."""

    def __init__(self, name: str, cwd: Path) -> None:
        self.base = ["tmux", "-L", name]
        subprocess.run([*self.base, "new-session", "-d", "-s", "t", "-x", "200", "-y", "50",
                        "bash --norc --noprofile -i"], check=True, cwd=cwd, timeout=30,
                       env={"PATH": "/usr/local/bin:/usr/bin:/bin", "TERM": "xterm",
                            "HOME": str(cwd), "PS1": "$ "})

    def type(self, line: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "t", "-l", line], check=True, timeout=30)
        subprocess.run([*self.base, "send-keys", "-t", "t", "Enter"], check=True, timeout=30)

    def screen(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", "t"], capture_output=True,
                              text=True, timeout=30).stdout

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)


def test_jobs_typed_at_a_shell_in_the_cgroup_and_the_shell_after_the_hold(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """As a person does it: a shell in a real terminal (tmux) moved into the guarded cgroup,
    two jobs typed at its prompt (started apart from the terminal: setsid, output to files, so
    that they are not the shell's children and restore as they are). The larger is
    checkpointed; the writer and the shell itself are held for the dump (the shell is the
    cgroup's too), and the shell answers the next line typed as before."""
    cg = _v1(cgroups.make("matestty", LIMIT))
    guard = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    term = Tmux(f"og-mates-{os.getpid()}", tmp_path)
    v_log, w_log = tmp_path / "v.log", tmp_path / "w.log"
    pids: dict[str, int] = {}

    def started(name: str) -> int:
        assert wait_until(lambda: (tmp_path / f"{name}.pid").exists()
                          and (tmp_path / f"{name}.pid").read_text().strip(), 30), term.screen()
        pids[name] = int((tmp_path / f"{name}.pid").read_text())
        return pids[name]

    try:
        guard.wait_event("guard.ready")
        term.type(f"cd {tmp_path} && set +m && echo $$ > {cg.path}/cgroup.procs && "
                  "echo $$ > shell.pid")
        shell = started("shell")
        v_argv = " ".join(hog_argv(v_log, target=180, rate=300, count=400, tick=0.01))
        term.type(f"(setsid {v_argv} < /dev/null > v.err 2>&1 & echo $! > v.pid)")
        v = started("v")
        assert wait_until(lambda: last_count(v_log) >= 45, 60), term.screen()
        w_argv = " ".join([*hog_argv(w_log, target=130, rate=1000, count=400, tick=0.01),
                           "--write", str(tmp_path / "w.dat"), "--write-kib", "512",
                           "--write-max", "16"])
        term.type(f"(setsid {w_argv} < /dev/null > w.err 2>&1 & echo $! > w.pid)")
        w = started("w")
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        frozen = guard.events("victim.frozen")[0]
        assert frozen["pid"] == done["pid"] == v, guard.log.read_text()[-3000:]
        assert sorted(frozen["others_held"]) == sorted([shell, w])
        assert _failcnt(cg) == 0
        term.type("echo shell-alive-$((6 * 7))")
        assert wait_until(lambda: "shell-alive-42" in term.screen(), 30), term.screen()
        assert proc_state(shell) not in (None, "T")
        assert wait_until(lambda: _done(w_log), 60), w_log.read_text()[-200:]
        err = (tmp_path / "w.err").read_text()
        assert "ENOMEM" not in err and cg.snapshot().oom_kills == 0, err
    finally:
        term.close()
        guard.stop()
        for pid in pids.values():
            kill_pid(pid)
    _restore_and_finish(store, done["id"], cgroups, v_log)
