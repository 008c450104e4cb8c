"""Many users at once on the control socket, as the attackers did it: eight real users each
holding every idle connection they may, and one user pipelining valid calls on eight
connections. Root is never locked out, a refused user reads one line, idle connections are
closed after the configured timeout, the log stays small, and the guard still checkpoints a
hog in a guarded cgroup meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.control.client import ControlClient
from oomguard.control.limits import MAX_CONNECTIONS, MAX_PER_UID, ROOT_RESERVE
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration
CROWD = [(f"oomguard-t-crowd{i}", 40260 + i) for i in range(9)]
PIPER = ("oomguard-t-piper", 40270)

# Once told to (a line on stdin), opens N connections and sends nothing on them. Prints
# {"held", "refused", "reasons"} once they are open, then, once the daemon has closed every
# held one, {"closed": [wall clock of each close], "opened": wall clock when they were opened}.
HOLDER = r"""
import json, selectors, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
sys.stdin.readline()
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socks.append(s)
opened = time.time()
time.sleep(0.5)  # a refusal comes at once, before the daemon starts a thread
held, refused, reasons = [], 0, set()
for s in socks:
    s.setblocking(False)
    try:
        data = s.recv(4096)
    except BlockingIOError:
        held.append(s)
        continue
    if b"TooManyConnections" in data:
        refused += 1
        reasons.add(json.loads(data.rstrip(b"\0"))["parameters"]["message"])
    s.close()
print(json.dumps({"held": len(held), "refused": refused, "reasons": sorted(reasons)}),
      flush=True)
closed = []
sel = selectors.DefaultSelector()
for s in held:
    s.setblocking(True)
    sel.register(s, selectors.EVENT_READ)
while len(closed) < len(held):
    for key, _ in sel.select(timeout=120):
        if key.fileobj.recv(4096) == b"":
            closed.append(time.time())
            sel.unregister(key.fileobj)
print(json.dumps({"closed": closed, "opened": opened}), flush=True)
"""

# Pipelines org.varlink.service.GetInfo on N connections for D seconds, reading the replies;
# prints {"replies": how many came, "seconds": how long it ran}.
PIPER_SCRIPT = r"""
import json, socket, sys, threading, time
path, n, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
call = json.dumps({"method": "org.varlink.service.GetInfo"}).encode() + b"\0"
replies = [0] * n
start = time.monotonic()
end = start + duration
def pipe(i):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(0.1)
    sent = 0
    while time.monotonic() < end:
        if sent - replies[i] < 400:
            try:
                s.sendall(call * 100)
                sent += 100
            except TimeoutError:
                pass
        try:
            replies[i] += s.recv(1 << 16).count(b"\0")
        except TimeoutError:
            pass
    s.close()
threads = [threading.Thread(target=pipe, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"replies": sum(replies), "seconds": time.monotonic() - start}), flush=True)
"""


def as_user(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def user_popen(uid: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*as_user(uid), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/",
                            stdin=subprocess.PIPE, env={"PATH": os.environ["PATH"]})


def oomguard_status(sock: Path, uid: int | None = None) -> subprocess.CompletedProcess[str]:
    """`oomguard --socket SOCK status` run to its end, as root or as `uid`."""
    argv = [sys.executable, "-m", "oomguard", "--socket", str(sock), "status"]
    return subprocess.run([*(as_user(uid) if uid is not None else []), *argv],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"]})


def write_config(path: Path, store: Path, sock: Path, **daemon_keys: object) -> Path:
    lines = ["[daemon]", f'store = "{store}"', f'socket = "{sock}"',
             *(f"{key} = {json.dumps(value)}" for key, value in daemon_keys.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def threads_of(pid: int) -> set[int]:
    """The thread ids of `pid` now (a thread that ends never comes back by its id)."""
    return {int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()}


def test_eight_users_holding_every_idle_connection_never_lock_root_out(
        store: Path, tmp_path: Path) -> None:
    idle_s = 15.0
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    config = write_config(tmp_path / "oomguard.toml", store, sock,
                          control_idle_timeout=f"{idle_s:g}s")
    with daemon(store, tmp_path / "daemon.log", socket=sock, config=config) as guard:
        guard.wait_event("guard.started")
        assert wait_until(sock.exists, 10)
        before = threads_of(guard.handle.pid)
        users = [unprivileged_user(name, uid) for name, uid in CROWD]
        crowd = [user_popen(uid, [sys.executable, "-c", HOLDER, str(sock), str(MAX_PER_UID)])
                 for uid in users[:8]]
        opened = []
        try:
            for holder in crowd:  # one after the other: the first seven fill the users' slots
                assert holder.stdin is not None
                holder.stdin.write("go\n")
                holder.stdin.flush()
                opened.append(json.loads(_line(holder)))
            # Every slot but root's reserve is taken; the eighth user was refused, with why.
            assert [o["held"] for o in opened] == [MAX_PER_UID] * 7 + [0], opened
            assert opened[7]["refused"] == MAX_PER_UID, opened
            assert all("kept for root" in r for r in opened[7]["reasons"]), opened
            assert 7 * MAX_PER_UID == MAX_CONNECTIONS - ROOT_RESERVE
            # One thread per held connection (and only those are waited for below: the
            # daemon may start a thread of its own meanwhile).
            holding = threads_of(guard.handle.pid) - before
            assert len(holding) >= 7 * MAX_PER_UID, (len(holding), before)
            # Root's `oomguard status` still answers.
            root = oomguard_status(sock)
            answered = time.time()
            assert root.returncode == 0, root.stderr
            assert "Traceback" not in root.stderr
            # A user at their share, and one with no connection at all (the users' slots are
            # full): one line each, exit 1, no traceback.
            full = users[0]
            for uid, why in ((full, f"too many connections from uid {full}"),
                             (users[8], "kept for root")):
                refused = oomguard_status(sock, uid)
                assert refused.returncode == 1, (refused.stdout, refused.stderr)
                assert "Traceback" not in refused.stderr
                lines = refused.stderr.strip().splitlines()
                assert len(lines) == 1 and why in lines[0], refused.stderr
            # The idle connections are closed after the timeout: not before (they were all
            # still open while root was answered), not much after.
            for holder, o in zip(crowd, opened, strict=False):
                closes = json.loads(_line(holder, timeout=idle_s + 60))
                assert len(closes["closed"]) == o["held"]
                for closed in closes["closed"]:
                    assert closed > answered
                    assert idle_s - 1 <= closed - closes["opened"] <= idle_s + 10, closes
            assert wait_until(lambda: not threads_of(guard.handle.pid) & holding, 10), \
                sorted(threads_of(guard.handle.pid) & holding)
            with ControlClient(sock) as client:
                assert "status" in client.call("Status")
        finally:
            for holder in crowd:
                holder.kill()
                holder.wait()
        idled = guard.events("control.idle_closed")
        assert 1 <= len(idled) <= 8  # once a minute per uid, not once per connection
        assert all(e["idle_s"] == idle_s for e in idled)


def test_pipelined_calls_are_paced_the_log_stays_small_and_the_guard_acts(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("piped", 256 * MiB)
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    log = tmp_path / "daemon.log"
    with daemon(store, log, "--cgroup", str(cg.path), socket=sock) as guard:
        guard.wait_event("guard.armed")
        assert wait_until(sock.exists, 10)
        uid = unprivileged_user(*PIPER)
        size_before = log.stat().st_size
        piper = user_popen(uid, [sys.executable, "-c", PIPER_SCRIPT, str(sock), "8", "6"])
        try:
            # Meanwhile a hog in the guarded cgroup is checkpointed, not OOM-killed.
            hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                               count=100_000))
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert done["pid"] == hog.pid
            hog.wait(timeout=10)
            assert cg.snapshot().oom_kills == 0
            result = json.loads(_line(piper, timeout=60))
        finally:
            piper.kill()
            piper.wait()
        # Answered, at the user's rate (a burst of 40, then 20 a second), not as fast as sent.
        assert 0 < result["replies"] <= 40 + 20 * (result["seconds"] + 1), result
        with ControlClient(sock) as root:  # root is never paced
            for _ in range(100):
                root.call("Status")
        grown = log.stat().st_size - size_before
        control = [e for e in guard.events() if str(e.get("event")).startswith("control.")]
        assert len(guard.events("control.rate_limited")) == 1, control
        # The checkpoint's own lines (a few KiB), one line saying the user is paced, routine
        # calls only at debug (one summary a minute, none yet): not a line per call.
        assert [e["event"] for e in control if e.get("uid") == uid] == \
            ["control.rate_limited"], control
        assert not [e for e in control if e.get("uid") == 0
                    and e.get("method") in ("Status", "GetInfo")], control
        assert len(guard.events("control.calls")) <= 1, control
        assert grown < 32 * 1024, grown


def _line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    """The next line `proc` writes, within `timeout` (its stderr when it ends instead)."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line within {timeout}s")
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(proc.stderr.read() if proc.stderr else "no output")
    return line
