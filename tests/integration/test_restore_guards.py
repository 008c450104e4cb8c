"""Restore guards (issue 12): no restore straight back into the pressure, never checkpoint
oomguard or its caller, the restored job's exit status recorded, and failed restores that say
why. Real daemon, real cgroups, real CRIU, real jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemoryCgroup
from oomguard.control.client import ControlClient, ControlError
from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    parse_events,
    proc_state,
    read_counts,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration

# A job that counts into a log it keeps open, and exits with the number written into its
# control file (so a restored job can be told to end with a status of the test's choosing).
STOPPABLE_JOB = """
import os, sys, time
log = open(sys.argv[1], "a", buffering=1)
count = 0
while True:
    count += 1
    log.write(f"{count}\\n")
    try:
        code = open(sys.argv[2]).read().strip()
    except FileNotFoundError:
        code = ""
    if code:
        sys.exit(int(code))
    time.sleep(0.05)
"""


def cli(socket: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The CLI through the daemon's socket (as any user would use it)."""
    argv = [sys.executable, "-m", "oomguard", "--socket", str(socket), "--log-format", "json",
            *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def test_no_restore_straight_back_into_the_pressure(cgroups: CgroupFactory, store: Path,
                                                    tmp_path: Path) -> None:
    """A 352 MiB job checkpointed from a 400 MiB cgroup that acts at 85% (340 MiB) does not
    fit back: `restore` refuses (saying what is free and the ways out), --wait --timeout gives
    up, and --wait restores it once the limit is raised; the job continues without a gap."""
    cg = cgroups.make("pressure", 400 * MiB)
    log = tmp_path / "hog.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                "--threshold", "85%") as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(log, target=352, rate=400, count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=90)[0]
        assert hog.wait(timeout=20) == -signal.SIGKILL
        checkpoint_id = done["id"]
        mark = last_count(log)

        refused = cli(guard.socket, "restore", checkpoint_id)
        assert refused.returncode == 1, refused.stderr
        reason = [line for line in refused.stderr.splitlines() if line.startswith("oomguard:")]
        assert len(reason) == 1, refused.stderr  # one line
        assert "its guard acts at 85% of 400 MiB" in reason[0]
        assert "free under that" in reason[0]
        assert "--cgroup PATH" in reason[0] and "--wait" in reason[0]
        # The same for --cgroup naming the guarded cgroup itself.
        named = cli(guard.socket, "restore", checkpoint_id, "--cgroup", str(cg.path))
        assert named.returncode == 1 and "its guard acts at 85%" in named.stderr
        failed = guard.wait_event("restore.failed", count=2)
        assert all(e["id"] == checkpoint_id and "its guard acts" in e["error"] for e in failed)

        # It could never fit there (352 + 64 MiB over 85% of 400 MiB): --wait does not wait
        # (issue 26, item 11).
        never = cli(guard.socket, "restore", checkpoint_id, "--wait", "--timeout", "60s")
        assert never.returncode == 1, never.stderr
        assert "even with nothing else in it" in never.stderr
        assert "waiting until it fits" not in never.stderr

        # Room it fits into, taken for now by another job: --wait waits (and gives up at its
        # timeout), then restores it once that job has gone.
        cg.set_limit(1024 * MiB)
        filler_log = tmp_path / "filler.log"
        filler = start_in_cgroup(cg, hog_argv(filler_log, target=600, rate=400, count=100_000))
        assert wait_until(lambda: _held(filler_log) >= 600, 60), filler_log.read_text()[-200:]
        gave_up = cli(guard.socket, "restore", checkpoint_id, "--wait", "--timeout", "2s")
        assert gave_up.returncode == 1
        assert "waiting until it fits (Ctrl-C to give up, at most 2s)" in gave_up.stderr
        assert "gave up after waiting 2s" in gave_up.stderr
        assert Store(store).get(checkpoint_id).state == "checkpointed"
        assert last_count(log) == mark  # nothing ran

        waiting = subprocess.Popen(
            [sys.executable, "-m", "oomguard", "--socket", str(guard.socket), "--log-format",
             "json", "restore", checkpoint_id, "--wait", "--timeout", "120s"],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        pid = None
        try:
            time.sleep(3)  # still refused: nothing changed
            assert waiting.poll() is None and not guard.events("restore.done")
            kill_pid(filler.pid)
            filler.wait(timeout=30)
            out, err = waiting.communicate(timeout=150)
            assert waiting.returncode == 0, err
            assert "waiting until it fits" in err
            pid = int(out.strip())
            assert wait_until(lambda: last_count(log) > mark + 5, 60)
            counts = read_counts(log)
            assert counts == list(range(1, len(counts) + 1))  # went on where it was
            assert guard.wait_event("restore.done")[0]["id"] == checkpoint_id
            assert cg.snapshot().oom_kills == 0
        finally:
            if waiting.poll() is None:
                waiting.kill()
            kill_pid(filler.pid)
            if pid is not None:
                kill_pid(pid)


def _held(log: Path) -> int:
    """MiB a hog holds, from its last full line ("COUNT MiB")."""
    lines = log.read_text().splitlines()[:-1] if log.exists() else []
    fields = lines[-1].split() if lines else []
    return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else 0


def test_a_script_cannot_checkpoint_its_own_parent_tree(cgroups: CgroupFactory, store: Path,
                                                        tmp_path: Path) -> None:
    """`oomguard checkpoint $$` from a script names a tree that holds the CLI itself: refused
    before anything is stopped, promptly, directly and through the daemon."""
    cg = cgroups.make("selfcli", None)
    with daemon(store, tmp_path / "daemon.log") as guard:
        guard.wait_event("guard.started")
        assert wait_until(guard.socket.exists, 10)
        for mode, route, who in (
                ("direct", ["--store", str(store)], "oomguard itself"),
                ("socket", ["--socket", str(guard.socket)], "the process asking for the")):
            out = tmp_path / f"{mode}.out"
            oomguard = " ".join([sys.executable, "-m", "oomguard", "--log-format", "json",
                                 *route])
            script = (f'{oomguard} checkpoint $$ > "{out}" 2>&1; echo "rc=$?" >> "{out}"; '
                      f'echo after >> "{out}"')
            job = start_in_cgroup(cg, ["/bin/sh", "-c", script], cwd=REPO)
            try:
                assert job.wait(timeout=60) == 0  # it came back: nothing was left stopped
            finally:
                kill_pid(job.pid)
            text = out.read_text()
            assert "rc=1" in text and text.rstrip().endswith("after"), text
            assert "refused before stopping it" in text and who in text, text
            assert "untouched" in text, text
        assert Store(store).list() == []
        assert guard.handle.poll() is None


def test_the_daemon_refuses_to_checkpoint_itself_or_its_caller(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Over the socket: the daemon's own pid, and a tree holding the calling process (known
    by SO_PEERCRED) are refused, untouched; the daemon goes on answering."""
    with daemon(store, tmp_path / "daemon.log") as guard:
        guard.wait_event("guard.started")
        assert wait_until(guard.socket.exists, 10)
        with ControlClient(guard.socket) as client:
            with pytest.raises(ControlError) as refused:
                client.call("Checkpoint", pid=guard.handle.pid)
            assert "oomguard itself" in str(refused.value)
            assert "untouched" in str(refused.value)
            # This test process is the caller; its parent's tree holds it.
            with pytest.raises(ControlError) as mine:
                client.call("Checkpoint", pid=os.getpid())
            assert "the process asking for the checkpoint" in str(mine.value)
            assert proc_state(guard.handle.pid) not in ("T", "t")
            assert client.call("Status")["status"]["daemon"] is True
        assert Store(store).list() == []


def test_a_failed_restore_says_why_and_the_restored_jobs_exit_status_is_recorded(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Through a real daemon: a restore CRIU cannot do (the job's open log was moved away)
    fails with CRIU's reason in one line, in the CLI and in the daemon's restore.failed, and
    leaves the checkpoint restorable; restored, the job is then told to exit 3: the daemon
    logs restore.exited with status 3, and `show` has it."""
    cg = cgroups.make("exits", None)
    log = tmp_path / "job.log"
    control = tmp_path / "job.exit"
    with daemon(store, tmp_path / "daemon.log") as guard:
        guard.wait_event("guard.started")
        assert wait_until(guard.socket.exists, 10)
        job = start_in_cgroup(cg, [sys.executable, "-c", STOPPABLE_JOB, str(log), str(control)])
        assert wait_until(lambda: last_count(log) > 5, 20)
        done = cli(guard.socket, "checkpoint", str(job.pid))
        assert done.returncode == 0, done.stderr
        checkpoint_id = done.stdout.strip()
        assert job.wait(timeout=10) == -signal.SIGKILL

        aside = tmp_path / "job.log.aside"
        log.rename(aside)
        failed = cli(guard.socket, "restore", checkpoint_id)
        assert failed.returncode == 1
        reason = [line for line in failed.stderr.splitlines() if line.startswith("oomguard:")]
        assert len(reason) == 1 and "the checkpoint is intact" in reason[0], failed.stderr
        assert "job.log" in reason[0], reason  # CRIU's own line names the missing file
        event = guard.wait_event("restore.failed")[0]
        assert event["id"] == checkpoint_id and "job.log" in event["error"]
        assert "\n" not in event["error"]
        assert Store(store).get(checkpoint_id).state == "checkpointed"

        aside.rename(log)
        mark = last_count(log)
        restored = cli(guard.socket, "restore", checkpoint_id)
        assert restored.returncode == 0, restored.stderr
        pid = int(restored.stdout.strip())
        try:
            assert wait_until(lambda: last_count(log) > mark + 3, 30)
            control.write_text("3\n")
            exited = guard.wait_event("restore.exited", timeout=30)[0]
        finally:
            kill_pid(pid)
        assert exited["id"] == checkpoint_id and exited["pid"] == pid
        assert exited["exit_status"] == 3 and exited["exit_signal"] is None
        assert exited["status"] == "exited with status 3"
        shown = cli(guard.socket, "show", checkpoint_id, "--json")
        assert shown.returncode == 0, shown.stderr
        meta = json.loads(shown.stdout)
        assert meta["exit_status"] == 3 and meta["exited_at"] is not None
        assert meta["state"] == "restored" and meta["restored_pid"] == pid
        told = cli(guard.socket, "show", checkpoint_id)  # for people
        assert told.returncode == 0, told.stderr
        assert "with status 3" in told.stdout and f"as PID {pid} into" in told.stdout


def test_a_killed_restored_job_records_the_signal(cgroups: CgroupFactory, store: Path,
                                                  tmp_path: Path) -> None:
    """The signal that ended a restored job is recorded, once."""
    cg = cgroups.make("killed", None)
    log = tmp_path / "job.log"
    with daemon(store, tmp_path / "daemon.log") as guard:
        guard.wait_event("guard.started")
        assert wait_until(guard.socket.exists, 10)
        job = start_in_cgroup(cg, [sys.executable, "-c", STOPPABLE_JOB, str(log),
                                   str(tmp_path / "never")])
        assert wait_until(lambda: last_count(log) > 5, 20)
        checkpoint_id = cli(guard.socket, "checkpoint", str(job.pid)).stdout.strip()
        job.wait(timeout=10)
        restored = cli(guard.socket, "restore", checkpoint_id)
        assert restored.returncode == 0, restored.stderr
        pid = int(restored.stdout.strip())
        os.kill(pid, signal.SIGTERM)
        exited = guard.wait_event("restore.exited", timeout=30)[0]
        assert exited["exit_signal"] == "SIGTERM" and exited["exit_status"] is None
        assert Store(store).get(checkpoint_id).exit_signal == "SIGTERM"
        events = parse_events((tmp_path / "daemon.log").read_text())
        assert [e["event"] for e in events].count("restore.exited") == 1


def test_a_daemon_restarted_meanwhile_still_records_the_exit(cgroups: CgroupFactory,
                                                             store: Path, tmp_path: Path) -> None:
    """The daemon that restored a job is killed (SIGKILL); the next one finds the job still
    running at start, watches it again and records its exit status."""
    cg = cgroups.make("restart", None)
    log = tmp_path / "job.log"
    control = tmp_path / "job.exit"
    with daemon(store, tmp_path / "first.log") as first:
        first.wait_event("guard.started")
        assert wait_until(first.socket.exists, 10)
        job = start_in_cgroup(cg, [sys.executable, "-c", STOPPABLE_JOB, str(log), str(control)])
        assert wait_until(lambda: last_count(log) > 5, 20)
        checkpoint_id = cli(first.socket, "checkpoint", str(job.pid)).stdout.strip()
        job.wait(timeout=10)
        restored = cli(first.socket, "restore", checkpoint_id)
        assert restored.returncode == 0, restored.stderr
        pid = int(restored.stdout.strip())
        first.handle.send_signal(signal.SIGKILL)
        first.handle.wait(timeout=10)
    try:
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 3, 20)  # the job outlived it
        with daemon(store, tmp_path / "second.log") as second:
            watching = second.wait_event("restore.watching")[0]
            assert watching["ids"] == [checkpoint_id]
            control.write_text("4\n")
            exited = second.wait_event("restore.exited", timeout=30)[0]
            assert exited["pid"] == pid and exited["exit_status"] == 4
        assert Store(store).get(checkpoint_id).exit_status == 4
    finally:
        kill_pid(pid)


def test_direct_restore_waits_for_room_under_the_limit(cgroups: CgroupFactory, store: Path,
                                                       tmp_path: Path) -> None:
    """Without a daemon (--store) the check is the limit's: a checkpoint larger than the
    limit is refused at once, --wait or not (issue 26, item 11); one that does not fit now is
    refused with the ways out, and --wait restores it once the room is there."""
    cg = cgroups.make("direct", 512 * MiB)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=160, rate=400, count=100_000))
    assert wait_until(lambda: last_count(log) > 45, 30)
    done = subprocess.run([sys.executable, "-m", "oomguard", "--store", str(store),
                           "--log-format", "json", "checkpoint", str(hog.pid)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    checkpoint_id = done.stdout.strip()
    hog.wait(timeout=10)
    cg.set_limit(128 * MiB)
    direct = [sys.executable, "-m", "oomguard", "--store", str(store), "--log-format", "json",
              "restore", checkpoint_id]
    for never in (direct, [*direct, "--wait", "--timeout", "120s"]):
        refused = subprocess.run(never, capture_output=True, text=True, timeout=60,
                                 cwd=REPO, stdin=subprocess.DEVNULL)
        assert refused.returncode == 1, refused.stderr
        assert "limited to 128 MiB" in refused.stderr and "never fit" in refused.stderr
        assert "waiting until it fits" not in refused.stderr
    cg.set_limit(512 * MiB)
    filler_log = tmp_path / "filler.log"
    filler = start_in_cgroup(cg, hog_argv(filler_log, target=400, rate=400, count=100_000))
    assert wait_until(lambda: _held(filler_log) >= 400, 60), filler_log.read_text()[-200:]
    refused = subprocess.run(direct, capture_output=True, text=True, timeout=120, cwd=REPO,
                             stdin=subprocess.DEVNULL)
    assert refused.returncode == 1
    assert "free under its limit" in refused.stderr and "--wait" in refused.stderr
    waiting = subprocess.Popen([*direct, "--wait", "--timeout", "120s"], cwd=REPO,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        assert wait_until(lambda: waiting.poll() is not None, 3) is False  # still waiting
        kill_pid(filler.pid)
        filler.wait(timeout=30)
        out, err = waiting.communicate(timeout=150)
        assert waiting.returncode == 0, err
        assert "waiting until it fits" in err
        pid = int(out.strip())
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 5, 30)
        counts = read_counts(log)
        assert counts == list(range(1, len(counts) + 1))
    finally:
        if waiting.poll() is None:
            waiting.kill()
        kill_pid(filler.pid)
        if pid is not None:
            kill_pid(pid)


def test_a_daemon_inside_its_guarded_cgroup_never_takes_itself_along(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A script starts the daemon and a hog in the cgroup the daemon guards: the tree rooted
    at the script holds the daemon, so the script is never a victim; the hog is checkpointed
    on its own, and the script and the daemon go on."""
    cg = cgroups.make("inside", 600 * MiB)
    log = tmp_path / "hog.log"
    daemon_log = tmp_path / "daemon.log"
    socket = tmp_path / "s" / "control.sock"
    argv = [sys.executable, "-m", "oomguard", "--store", str(store), "--socket", str(socket),
            "--log-format", "json", "run", "--cgroup", str(cg.path), "--threshold", "50%"]
    script = ('"$@" >> "$DAEMON_LOG" 2>&1 & echo $! > "$DAEMON_PID"\n'
              'while ! grep -q guard.armed "$DAEMON_LOG"; do sleep 0.1; done\n'
              f'{" ".join(hog_argv(log, target=400, rate=200, count=100_000))}\n'
              'echo "hog ended $?" >> "$HOG_END"; sleep 600\n')
    env = {**os.environ, "DAEMON_LOG": str(daemon_log),
           "DAEMON_PID": str(tmp_path / "daemon.pid"), "HOG_END": str(tmp_path / "hog.end")}
    runner = subprocess.Popen(
        ["/bin/sh", "-c", 'echo $$ > "$0" && s="$1" && shift && exec /bin/sh -c "$s" sh "$@"',
         str(cg.path / "cgroup.procs"), script, *argv],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    daemon_pid = None
    try:
        assert wait_until(lambda: (tmp_path / "hog.end").exists()
                          and "checkpoint.done" in daemon_log.read_text(), 60), \
            daemon_log.read_text()[-3000:]
        daemon_pid = int((tmp_path / "daemon.pid").read_text())
        events = parse_events(daemon_log.read_text())
        done = [e for e in events if e.get("event") == "checkpoint.done"]
        assert len(done) == 1, daemon_log.read_text()[-3000:]
        assert done[0]["pid"] != runner.pid  # the hog, not the script holding the daemon
        assert "hog ended 137" in (tmp_path / "hog.end").read_text()  # CRIU killed it
        assert runner.poll() is None and proc_state(runner.pid) not in ("T", "t")
        assert proc_state(daemon_pid) not in (None, "T", "t")
        assert cg.snapshot().oom_kills == 0
    finally:
        if daemon_pid is not None:
            os.kill(daemon_pid, signal.SIGTERM)
            wait_until(lambda: proc_state(daemon_pid) in (None, "Z"), 30)
        kill_pid(runner.pid)
        runner.wait()


def _fill_with_cache(cg: MemoryCgroup, path: Path, mib: int) -> None:
    """`mib` MiB of clean page cache charged to `cg`: a file written from inside it."""
    writer = start_in_cgroup(cg, ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}",
                                  "conv=fsync", "status=none"])
    assert writer.wait(timeout=60) == 0


@pytest.mark.parametrize("through", ["daemon", "direct"])
def test_a_cgroup_full_of_page_cache_has_room_for_a_restore(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, through: str) -> None:
    """Page cache is room: the kernel drops it for the restore's pages, and the guard acts on
    resident memory, not on cache. A cgroup whose jobs wrote files sits near its limit in
    cache for good; both the guard's rule (through the daemon) and the limit's (root on the
    store) counted that cache as used, so no restore into it ever fitted (the 60-minute soak:
    its restore cgroup at 1.96 of 2 GiB with one 196 MiB job, every restore refused, until the
    store's budget filled and checkpoints were refused)."""
    cg = cgroups.make(f"cached-{through}", 400 * MiB)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=120, rate=400, count=100_000))
    pid = None
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                "--threshold", "85%") as guard:
        try:
            guard.wait_event("guard.armed")
            assert wait_until(lambda: _held(log) >= 120, 30)
            done = cli(guard.socket, "checkpoint", str(hog.pid))
            assert done.returncode == 0, done.stderr
            checkpoint_id = done.stdout.strip()
            hog.wait(timeout=20)
            mark = last_count(log)
            _fill_with_cache(cg, tmp_path / "written.dat", 300)
            snap = cg.snapshot()
            # Counted as used, the cache leaves no room under 85% of 400 MiB (340 MiB) for a
            # 120 MiB job and the 64 MiB margin; resident, it leaves plenty.
            assert snap.usage_bytes + 184 * MiB > 340 * MiB, snap
            assert snap.unreclaimable_bytes + 184 * MiB < 340 * MiB, snap
            if through == "daemon":
                restored = cli(guard.socket, "restore", checkpoint_id)
            else:
                restored = subprocess.run(
                    [sys.executable, "-m", "oomguard", "--store", str(store), "--log-format",
                     "json", "restore", checkpoint_id], capture_output=True, text=True,
                    timeout=180, cwd=REPO, stdin=subprocess.DEVNULL)
            assert restored.returncode == 0, restored.stderr
            pid = int(restored.stdout.strip())
            assert wait_until(lambda: last_count(log) > mark + 5, 30)
            counts = read_counts(log)
            assert counts == list(range(1, len(counts) + 1))
            assert cg.snapshot().oom_kills == 0
        finally:
            kill_pid(hog.pid)
            if pid is not None:
                kill_pid(pid)
