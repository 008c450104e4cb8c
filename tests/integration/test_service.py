"""Checkpoints as a service: the control socket with per-user rights, auto-restore, integrity,
crash recovery of the store, repeated checkpoint/restore cycles. Real users, real processes,
real CRIU."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from oomguard.act.criu import find_criu
from oomguard.control.client import ControlClient
from oomguard.sense.procfs import ProcReader
from oomguard.sense.psi import has_cap_sys_resource
from oomguard.store.checkpoints import Store
from oomguard.store.pagedout import PagedOutRecord
from tests.helpers import (
    HOG,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    oomguard_argv,
    proc_state,
    read_counts,
    run_oomguard,
    short_socket_path,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
# Two unprivileged users, by number: SO_PEERCRED and CRIU need no passwd entry (and the VM
# lane's root file system is read-only, so none could be added there).
ALICE, BOB = 40001, 40002


def _cap_sys_resource() -> bool:
    return has_cap_sys_resource(Path("/proc/self/status").read_text())


def as_user(uid: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                           sys.executable, "-m", "oomguard", "--log-format", "json", *args],
                          capture_output=True, text=True, cwd="/", timeout=timeout,
                          stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"]})


def user_hog(cgroup: object, uid: int, workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log = workdir / f"{uid}.log"
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--", *hog_argv(log, target=32, rate=100, count=100_000)]
    return start_in_cgroup(cgroup, argv, cwd=workdir), log  # type: ignore[arg-type]


def raw_call(path: Path, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(payload)
        data = b""
        while b"\0" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


@pytest.mark.skipif(not _cap_sys_resource(),
                    reason="root here lacks CAP_SYS_RESOURCE, so CRIU cannot read another "
                           "user's rlimits (prlimit: EPERM) and cannot dump their processes; "
                           "this test runs in the v2 VM lane, where root has it")
def test_each_user_sees_and_restores_only_their_own(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    probe = subprocess.run(["setpriv", f"--reuid={ALICE}", f"--regid={ALICE}", "--clear-groups",
                            "--", sys.executable, "-c", "import oomguard"], cwd="/",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the checkout is not readable by other users: {probe.stderr[-200:]}")
    # pytest's tmp_path lies in a root-only directory: the users' files go elsewhere.
    workdir = Path(tempfile.mkdtemp(prefix="og-users-", dir="/tmp"))
    workdir.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    cg = cgroups.make("users", None)
    sock = short_socket_path()
    sock.parent.chmod(0o755)
    with daemon(store, tmp_path / "daemon.log", socket=sock) as guard:
        guard.wait_event("guard.started")
        assert wait_until(sock.exists, 10)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o666
        hogs = {}
        for uid in (ALICE, BOB):
            hogs[uid] = user_hog(cg, uid, workdir)
        assert wait_until(lambda: all(last_count(log) > 5 for _, log in hogs.values()), 20)
        ids = {}
        for uid, (hog, _log) in hogs.items():
            result = as_user(uid, "--socket", str(sock), "checkpoint", str(hog.pid))
            assert result.returncode == 0, result.stderr
            ids[uid] = result.stdout.strip()
            assert hog.wait(timeout=10) == -signal.SIGKILL
        assert stat.S_IMODE(store.stat().st_mode) == 0o700

        for uid, other in ((ALICE, BOB), (BOB, ALICE)):
            listed = as_user(uid, "--socket", str(sock), "list", "--json")
            assert listed.returncode == 0, listed.stderr
            assert [c["id"] for c in json.loads(listed.stdout)] == [ids[uid]]
            for verb in ("show", "restore", "forget"):
                refused = as_user(uid, "--socket", str(sock), verb, ids[other])
                assert refused.returncode == 1
                assert f"no checkpoint '{ids[other]}' of yours" in refused.stderr
        with ControlClient(sock) as root:
            assert sorted(c["id"] for c in root.call("List")["checkpoints"]) == sorted(ids.values())

        # Checkpointing someone else's process is refused, and leaves it running.
        other_hog, other_log = user_hog(cg, BOB, workdir)
        try:
            assert wait_until(lambda: last_count(other_log) > 3, 20)
            refused = as_user(ALICE, "--socket", str(sock), "checkpoint", str(other_hog.pid))
            assert refused.returncode == 1 and "is not yours" in refused.stderr
            assert other_hog.poll() is None and proc_state(other_hog.pid) not in ("T", "t")
        finally:
            kill_pid(other_hog.pid)
            other_hog.wait()

        # A user may not restore into a cgroup that is not theirs (it would lift their limit).
        big = cgroups.make("notyours", None)
        refused = as_user(ALICE, "--socket", str(sock), "restore", ids[ALICE],
                          "--cgroup", str(big.path))
        assert refused.returncode == 1 and "delegated to you" in refused.stderr

        restored = as_user(ALICE, "--socket", str(sock), "restore", ids[ALICE])
        assert restored.returncode == 0, restored.stderr
        pid = int(restored.stdout.strip())
        try:
            assert ProcReader().process(pid).uid == ALICE
            mark = last_count(hogs[ALICE][1])
            assert wait_until(lambda: last_count(hogs[ALICE][1]) > mark + 5, 60)
            counts = read_counts(hogs[ALICE][1])
            assert counts == list(range(1, len(counts) + 1))
        finally:
            kill_pid(pid)

        # Garbage on the socket: a clear error each time, and the daemon goes on.
        reply = json.loads(raw_call(sock, b"this is not json\0").rstrip(b"\0"))
        assert reply["error"] == "io.oomguard.InvalidRequest"
        reply = json.loads(raw_call(sock, b'{"method": "io.oomguard.Nope"}\0').rstrip(b"\0"))
        assert reply["error"] == "org.varlink.service.MethodNotFound"
        reply = json.loads(raw_call(sock, b'{"method": "io.oomguard.Show", "parameters": '
                                          b'{"id": "../../etc"}}\0').rstrip(b"\0"))
        assert reply["error"] == "io.oomguard.InvalidRequest"
        reply = json.loads(raw_call(sock, b"x" * 70_000).rstrip(b"\0"))
        assert "larger than" in reply["parameters"]["message"]
        with ControlClient(sock) as root:
            status = root.call("Status")["status"]
        assert status["daemon"] is True and status["checkpoints"]["count"] == 2
        assert guard.handle.poll() is None


def test_auto_restore_when_the_limit_is_raised(cgroups: CgroupFactory, store: Path,
                                               tmp_path: Path) -> None:
    cg = cgroups.make("auto", 256 * MiB)
    log = tmp_path / "hog.log"
    config = tmp_path / "auto.toml"
    config.write_text(f'[daemon]\nrescan_interval = "500ms"\n\n[[guard]]\ncgroups = ["{cg.path}"]\n'
                      'auto_restore = true\nrestore_quiet = "1s"\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(log, target=400, rate=300, count=400))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert hog.wait(timeout=10) == -signal.SIGKILL
        time.sleep(3)  # it does not fit under 85% of 256 MiB: nothing must happen
        assert not guard.events("restore.auto")
        cg.set_limit(1024 * MiB)
        restored = guard.wait_event("restore.done", timeout=60)[0]
        assert restored["id"] == done["id"] and restored["auto"] is True
        try:
            assert wait_until(lambda: "done 400 ok" in log.read_text(), 60)
            assert read_counts(log) == list(range(1, 401))
            assert cg.snapshot().oom_kills == 0
        finally:
            kill_pid(restored["pid"])
    assert Store(store).get(done["id"]).state == "restored"


def test_a_corrupted_image_is_refused(cgroups: CgroupFactory, store: Path,
                                      tmp_path: Path) -> None:
    cg = cgroups.make("corrupt", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=32, rate=200, count=100_000))
    assert wait_until(lambda: last_count(log) > 5, 20)
    result = run_oomguard(store, "checkpoint", str(hog.pid))
    assert result.returncode == 0, result.stderr
    checkpoint_id = result.stdout.strip()
    hog.wait()
    pages = sorted((store / checkpoint_id / "images").glob("pages-*.img"))[0]
    with pages.open("r+b") as handle:
        handle.seek(4096 * 3 + 17)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    refused = run_oomguard(store, "restore", checkpoint_id)
    assert refused.returncode == 1
    assert "damaged" in refused.stderr and f"{pages.name} checksum mismatch" in refused.stderr
    assert Store(store).get(checkpoint_id).state == "checkpointed"
    assert not ProcReader().exists(hog.pid) or proc_state(hog.pid) == "Z"


def _dump_started(store: Path) -> bool:
    return any((p / "images" / "dump.log").exists() for p in Store(store).partials())


SLOW_FAILING_CRIU = """#!/bin/sh
case "$1" in
  --version|check) exec {criu} "$@" ;;
  *) sleep 3; echo "Error (simulated): gave up" >&2; exit 1 ;;
esac
"""


@pytest.mark.parametrize("moment", ["frozen", "dumping"])
def test_daemon_killed_mid_dump_restarts_consistent(cgroups: CgroupFactory, store: Path,
                                                     tmp_path: Path, moment: str) -> None:
    """SIGKILL the daemon once the victim is stopped but before CRIU has it (a CRIU that takes
    3 s to start, then fails: the restart must thaw the victim), or once the real CRIU is
    writing (it finishes on its own; the restart completes the checkpoint it left)."""
    cg = cgroups.make("sigkill", 900 * MiB)
    log = tmp_path / "hog.log"
    extra = []
    if moment == "frozen":
        slow = tmp_path / "criu-slow"
        slow.write_text(SLOW_FAILING_CRIU.format(criu=find_criu()[0]))
        slow.chmod(0o755)
        extra = ["--criu", str(slow)]
    first = DaemonProcess(store, tmp_path / "daemon1.log", "--cgroup", str(cg.path), *extra)
    try:
        first.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(log, target=1000, rate=1000, count=300, chunk=8))
        first.wait_event("victim.frozen", timeout=60)
        if moment == "dumping":
            assert wait_until(lambda: _dump_started(store), 10, interval=0.002)
        else:
            assert wait_until(lambda: Store(store).partials(), 10, interval=0.002)
        first.handle.send_signal(signal.SIGKILL)
        first.handle.wait()
    finally:
        first.stop()
    with daemon(store, tmp_path / "daemon2.log", "--cgroup", str(cg.path)) as second:
        second.wait_event("guard.armed")

        def settled() -> str:
            """'gone' (dumped), 'paged out' (the default chain's page-out), 'running' (not
            stopped while no action of the new run holds it), or '' while the old CRIU, a
            partial or the new run's own action is under way. Its state is read before the
            events: a freeze that begins after the read shows as an action begun. (Read as
            'not T' alone, the new run's dump under way passed while CRIU's parasite ran in
            it, and the next look found it stopped.)"""
            if hog.poll() is not None:
                return "gone"
            if second.events("victim.paged_out"):
                return "paged out"
            state = proc_state(hog.pid)
            begun = len(second.events("victim.frozen"))
            ended = len(second.events("checkpoint.done")) + len(second.events("checkpoint.failed"))
            if state in ("T", "t", None) or begun > ended or Store(store).partials():
                return ""
            return "running"
        # Left stopped in a cgroup over its threshold, the victim is not continued first: the
        # new run checkpoints it as it is (or it runs again, its cgroup under its threshold).
        # Whatever the race, the store ends consistent: no partial left once CRIU is done.
        verdict = wait_until(settled, 60)
        assert verdict, "victim left stopped, or a dump never ended:\n" + second.log.read_text()
        if verdict == "paged out":  # the old CRIU gave it back, the new run refused it while
            # traced by that CRIU: the default chain's page-out took it (held, on record)
            assert [t.root_pid for t in PagedOutRecord(store).trees()] == [hog.pid]
            assert proc_state(hog.pid) == "T" and not Store(store).partials()
            kill_pid(hog.pid)
            hog.wait()
            return
        if verdict == "running":
            kill_pid(hog.pid)
            hog.wait()
            assert all(c.state == "checkpointed" for c in Store(store).list())
            return
        hog.wait()
        assert wait_until(lambda: Store(store).list() and not Store(store).partials(), 30), \
            "the victim is neither running nor checkpointed:\n" + second.log.read_text()
        checkpoints = Store(store).list()
        assert all(c.state == "checkpointed" for c in checkpoints)
        assert len(checkpoints) == 1
        if moment == "dumping":
            assert wait_until(lambda: second.events("checkpoint.recovered"), 10), \
                second.log.read_text()
        else:  # no dump had begun: caught again by the new run, as it was left (stopped)
            assert wait_until(lambda: second.events("checkpoint.done"), 10)
            assert second.events("checkpoint.done")[0]["pid"] == hog.pid
    big = cgroups.make("sigkillbig", 1536 * MiB)
    result = run_oomguard(store, "restore", checkpoints[0].id, "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    try:
        assert wait_until(lambda: "done 300 ok" in log.read_text(), 60)
        assert read_counts(log) == list(range(1, 301))
    finally:
        kill_pid(int(result.stdout.strip()))


def test_three_checkpoint_restore_cycles_of_an_exec_workload(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("cycles", None)
    log = tmp_path / "hog.log"
    wrapper = start_in_cgroup(None, [*oomguard_argv(store), "exec", "--cgroup", str(cg.path),
                                     "--", sys.executable, str(HOG), "--log", str(log),
                                     "--target", "64", "--rate", "200", "--count", "600",
                                     "--tick", "0.01"], cwd=tmp_path)
    reader = ProcReader()
    assert wait_until(lambda: reader.children_of(wrapper.pid), 10)
    pid = reader.children_of(wrapper.pid)[0]  # PID 1 of the namespace, seen from the host
    try:
        for cycle in range(3):
            assert wait_until(lambda c=cycle: last_count(log) > 40 * (c + 1), 30)
            result = run_oomguard(store, "checkpoint", str(pid))
            assert result.returncode == 0, result.stderr
            assert Store(store).get(result.stdout.strip()).pidns
            assert wait_until(lambda p=pid: not reader.exists(p) or proc_state(p) == "Z", 10)
            mark = last_count(log)
            restored = run_oomguard(store, "restore", result.stdout.strip())
            assert restored.returncode == 0, restored.stderr
            pid = int(restored.stdout.strip())
            assert wait_until(lambda m=mark: last_count(log) > m, 20)
        assert wait_until(lambda: "done 600 ok" in log.read_text(), 60)
        assert read_counts(log) == list(range(1, 601))
        assert len(Store(store).list()) == 3
    finally:
        kill_pid(pid)
        wrapper.wait(timeout=10)
