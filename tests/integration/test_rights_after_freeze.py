"""The rights of an on-demand checkpoint are checked again on the tree as it stopped: a child
that execs a setuid-root program after the request was checked, before its SIGSTOP, is caught
there (a stopped task cannot exec). The request is refused, only the tasks oomguard stopped
are continued, and a task its user had stopped gets no SIGCONT.

The attacker is a real user (useradd) whose job keeps forking children that exec a
setuid-root copy of sleep, and asks the daemon through its socket, as that user, 60 times.
Its job holds a Unix connection to a server outside it, so that a request whose tree is all
the user's (no setuid child stopped in it) fails in CRIU and is thawed, on any host: the job
is never dumped away under the test."""

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
from tests.helpers import (
    CgroupFactory,
    as_user,
    daemon,
    kill_pid,
    outside_server,
    proc_state,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    users_workdir,
    wait_until,
)

pytestmark = pytest.mark.integration
EVE = 40036
REQUESTS = 60

ATTACKER = r"""
import os, random, signal, socket, sys, threading, time
suid, peer, shared = sys.argv[1], sys.argv[2], sys.argv[3]
link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
link.connect(peer)  # to a server outside the tree: CRIU cannot dump the job
# A child its user stopped: no one but the user (here the test) may continue it. It says who
# did: the sender of the first SIGCONT (a later one, while it is pending, is dropped).
kid = os.fork()
if kid == 0:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})
    os.kill(os.getpid(), signal.SIGSTOP)
    info = signal.sigtimedwait({signal.SIGCONT}, 5)
    with open(os.path.join(shared, "continued-by"), "w") as out:
        out.write(f"{info.si_pid if info else 0}\n")
    os._exit(0)
with open(os.path.join(shared, "stopped-kid"), "w") as out:
    out.write(f"{kid}\n")
def fork_setuid_children():
    while True:
        child = os.fork()
        if child == 0:  # the user's own for a moment, then root's (euid and saved uid)
            time.sleep(random.uniform(0.0, 0.004))
            os.execv(suid, [suid, "0.003"])
        os.waitpid(child, 0)
threading.Thread(target=fork_setuid_children, daemon=True).start()
time.sleep(900)
"""

# As the attacker: one request at a time on the daemon's socket; each answer a JSON line,
# the next request once the test says so (after it has looked at the tree).
ASKER = r"""
import json, sys
from oomguard.control.client import ControlClient, ControlError
sock, pid, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(count):
    try:
        with ControlClient(sock) as client:
            answer = {"ok": client.call("Checkpoint", pid=pid)}
    except ControlError as exc:
        answer = {"error": exc.name, "message": str(exc)}
    print(json.dumps(answer), flush=True)
    if sys.stdin.readline().strip() != "next":
        break
"""


def _written(path: Path) -> bool:
    """Whether the attacker has written its line there (the file is made before it is)."""
    try:
        return path.read_text().endswith("\n")
    except OSError:
        return False


def test_a_setuid_exec_between_the_check_and_the_freeze_is_refused_and_only_ours_continue(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    eve = unprivileged_user("oomguard-t-eve", EVE)
    shared = users_workdir(eve, "og-eve-")
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    suid_sleep = shared / "sleep"
    shutil.copy("/bin/sleep", suid_sleep)
    os.chown(suid_sleep, 0, 0)
    suid_sleep.chmod(0o4755)
    peer = shared / "peer.sock"
    server, accepted = outside_server(peer)
    peer.chmod(0o777)
    as_eve = as_user(eve)
    cg = cgroups.make("eve", None)
    job = start_in_cgroup(cg, [*as_eve, sys.executable, "-c", ATTACKER, str(suid_sleep),
                               str(peer), str(shared)], log=tmp_path / "attacker.log")
    reader = ProcReader()
    stopped_kid = 0
    try:
        assert wait_until(lambda: _written(shared / "stopped-kid") and accepted, 20), \
            (tmp_path / "attacker.log").read_text()
        stopped_kid = int((shared / "stopped-kid").read_text())
        assert wait_until(lambda: proc_state(stopped_kid) == "T", 10)
        sock = short_socket_path()
        sock.parent.chmod(0o755)
        answers: list[dict[str, str]] = []
        with daemon(store, tmp_path / "daemon.log", socket=sock) as guard:
            guard.wait_event("guard.started")
            assert wait_until(sock.exists, 10)
            asker = subprocess.Popen(
                [*as_eve, sys.executable, "-c", ASKER, str(sock), str(job.pid), str(REQUESTS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
                env={"PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parents[2])})
            assert asker.stdin is not None and asker.stdout is not None
            try:
                for _ in range(REQUESTS):
                    line = asker.stdout.readline()
                    assert line, f"the asker ended early: {asker.wait(10)}"
                    answer = json.loads(line)
                    # The answer is in: nothing of the job is stopped but the task its user
                    # stopped (a root task least of all).
                    tree = reader.descendants(job.pid)
                    left = [(pid, reader.process(pid).uids, state) for pid in tree
                            if pid != stopped_kid and (state := proc_state(pid)) == "T"]
                    assert not left, f"left stopped after {answer}: {left}"
                    # (CRIU, giving back a task it found stopped, stops it again itself: it
                    # runs in the kernel for a moment on the way.)
                    assert wait_until(lambda: proc_state(stopped_kid) == "T", 5), \
                        f"continued after {answer}"
                    answers.append(answer)
                    asker.stdin.write("next\n")
                    asker.stdin.flush()
            finally:
                asker.stdin.close()
                asker.wait(30)
            daemon_pid = guard.handle.pid
            refused_after = guard.events("checkpoint.refused_not_yours")
        # Every answer a refusal or a failure that says why; never a checkpoint.
        assert not [a for a in answers if "ok" in a], answers
        after_freeze = [a for a in answers if "found once the tree had stopped" in a["message"]]
        before = [a for a in answers if a not in after_freeze
                  and "every process of the tree must be yours" in a["message"]]
        failed = [a for a in answers if a not in after_freeze and a not in before]
        for a in after_freeze + before:
            assert a["error"] == "io.oomguard.PermissionDenied", a
            assert "holds the rights of uid 0" in a["message"], a
        for a in after_freeze:
            assert "refused, nothing dumped" in a["message"], a
        for a in failed:  # the tree was all the user's as it stopped: CRIU's own failure
            assert a["error"] == "io.oomguard.Failed" and "(process thawed)" in a["message"], a
        assert len(refused_after) == len(after_freeze)
        assert after_freeze, f"the race was never caught in {REQUESTS} requests: {answers}"
        print(f"\n{REQUESTS} requests: {len(after_freeze)} refused once stopped, {len(before)} "
              f"refused before, {len(failed)} failed in CRIU (thawed)")
        # The task its user stopped was never continued by the daemon: the first SIGCONT it
        # gets is the test's own.
        os.kill(stopped_kid, signal.SIGCONT)
        assert wait_until(lambda: (shared / "continued-by").exists(), 10)
        sender = int((shared / "continued-by").read_text())
        assert sender == os.getpid() != daemon_pid
    finally:
        for pid in reversed(reader.descendants(job.pid)):
            kill_pid(pid)
        kill_pid(job.pid)
        server.close()
        for conn in accepted:
            conn.close()
