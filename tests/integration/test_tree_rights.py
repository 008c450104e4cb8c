"""On-demand checkpoints take whole trees, so the whole tree is checked before anything is
stopped: a user's tree holding a setuid-root child (as sudo runs) is refused, and so is any
tree holding a task the guards never touch (oom_score_adj -1000), whoever asks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from oomguard.sense.procfs import ProcReader
from tests.helpers import (
    CgroupFactory,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    run_oomguard,
    short_socket_path,
    start_in_cgroup,
    unprivileged_user,
    wait_until,
)

pytestmark = pytest.mark.integration
MALLORY = 40032

PARENT_OF_SUID = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.argv[1], "300"])
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_users_tree_with_a_setuid_root_child_is_refused_untouched(
        cgroups: CgroupFactory, store: Path, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    bindir = Path(tempfile.mkdtemp(prefix="og-suid-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(bindir, ignore_errors=True))
    bindir.chmod(0o755)
    suid_sleep = bindir / "sleep"
    shutil.copy("/bin/sleep", suid_sleep)
    os.chown(suid_sleep, 0, 0)
    suid_sleep.chmod(0o4755)
    cg = cgroups.make("suid", None)
    mallory = unprivileged_user("oomguard-t-mallory2", MALLORY)
    as_mallory = ["setpriv", f"--reuid={mallory}", f"--regid={mallory}", "--clear-groups", "--"]
    parent = start_in_cgroup(cg, [*as_mallory, sys.executable, "-c", PARENT_OF_SUID,
                                  str(suid_sleep)])
    reader = ProcReader()
    try:
        kids = wait_until(lambda: reader.children_of(parent.pid), 10)
        assert kids, "the setuid child did not start"
        child = kids[0]
        assert wait_until(lambda: reader.process(child).uids[1] == 0, 10), "not setuid root"
        sock = short_socket_path()
        sock.parent.chmod(0o755)
        with daemon(store, tmp_path / "daemon.log", socket=sock) as guard:
            guard.wait_event("guard.started")
            assert wait_until(sock.exists, 10)
            asked = subprocess.run(
                [*as_mallory, sys.executable, "-m", "oomguard", "--socket", str(sock),
                 "checkpoint", str(parent.pid)], capture_output=True, text=True, cwd="/",
                timeout=60, stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"]})
        assert asked.returncode == 1
        assert f"process {child}" in asked.stderr and "uid 0" in asked.stderr
        assert "every process of the tree must be yours" in asked.stderr
        # Never stopped: no SIGSTOP reached either process.
        assert proc_state(child) == "S" and proc_state(parent.pid) == "S"
        assert not [e for e in guard.events() if e.get("event") in ("victim.frozen",
                                                                    "checkpoint.failed")]
    finally:
        for pid in reader.children_of(parent.pid):
            kill_pid(pid)
        kill_pid(parent.pid)


TRACER = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206  # attach without stopping the tracee, as a debugger's first step does
if libc.ptrace(PTRACE_SEIZE, int(sys.argv[1]), None, None) != 0:
    sys.exit(f"ptrace: errno {ctypes.get_errno()}")
print("attached", flush=True)
time.sleep(300)
"""


def test_a_tree_with_a_traced_process_is_refused_for_root_too(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """(oom_score_adj -1000 is refused the same way; this host's root lacks CAP_SYS_RESOURCE,
    which lowering it needs, so the unit tests cover that one.)"""
    cg = cgroups.make("traced", None)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=200, count=100_000))
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(hog.pid)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout is not None and tracer.stdout.readline().strip() == "attached"
        assert wait_until(lambda: last_count(log) > 5, 10)
        result = run_oomguard(store, "checkpoint", str(hog.pid))
        assert result.returncode == 1
        assert f"traced by process {tracer.pid}" in result.stderr
        assert "untouched" in result.stderr
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 3, 10), "it was left stopped"
    finally:
        kill_pid(tracer.pid)
        tracer.wait()
        kill_pid(hog.pid)
