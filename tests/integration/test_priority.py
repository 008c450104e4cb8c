"""The guard's niceness (daemon.nice) on the real kernel: the event loop and the idle action
workers run at it, and nothing the daemon starts or restores inherits it (a hook runs at 0, a
restored job at its own niceness: a priority never leaks to user processes)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from oomguard.act.priority import ThreadPriority
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration


def thread_nice(pid: int, tid: int) -> int:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice


def thread_tids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_a_raised_thread_starts_children_and_threads_at_zero() -> None:
    """SCHED_RESET_ON_FORK on the real kernel: the thread runs at -10, a process it starts and a
    thread it starts at 0; lowered, it is at 0 again."""
    priority = ThreadPriority(-10)
    seen: dict[str, int] = {}

    def work() -> None:
        assert priority.raise_(), priority.error
        seen["raised"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = os.popen(f"{sys.executable} -c 'import os; print(os.nice(0))'")
        seen["child"] = int(child.read())
        child.close()

        def inner() -> None:
            seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        t = threading.Thread(target=inner)
        t.start()
        t.join()
        priority.lower()
        seen["lowered"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == {"raised": -10, "child": 0, "thread": 0, "lowered": 0}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # only that thread


def test_the_guard_runs_at_its_niceness_and_nothing_it_starts_or_restores_does(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("nice", 256 * MiB)
    big = cgroups.make("nice-big", 768 * MiB)
    hook_out = tmp_path / "hook.nice"
    config = tmp_path / "nice.toml"
    config.write_text(f'[daemon]\nnice = -10\n\n[hooks]\non_checkpoint = "{sys.executable} -c '
                      f"'import os; print(os.nice(0))' > {hook_out}\"\n\n"
                      f'[[guard]]\ncgroups = ["{cg.path}"]\n')
    log = tmp_path / "hog.log"
    pid = None
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        assert guard.wait_event("guard.started")[0]["nice"] == -10
        guard.wait_event("guard.armed")
        daemon_pid = guard.handle.pid
        assert thread_nice(daemon_pid, daemon_pid) == -10  # the event loop's thread
        hog = start_in_cgroup(cg, hog_argv(log, target=400, rate=300, count=400))
        os.setpriority(os.PRIO_PROCESS, hog.pid, 3)  # the job's own niceness
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        hog.wait(timeout=10)
        assert wait_until(lambda: hook_out.exists() and hook_out.read_text().strip(), 10)
        assert int(hook_out.read_text()) == 0  # what the daemon starts runs at 0
        # The worker that stopped the hog waits for the next crossing at the guard's niceness
        # (Python 3.11 does not name its threads in /proc: counted beside the loop's).
        assert wait_until(lambda: sum(thread_nice(daemon_pid, tid) == -10
                                      for tid in thread_tids(daemon_pid)) >= 2, 10)
        result = run_oomguard(store, "--socket", str(guard.socket), "restore", done["id"],
                              "--cgroup", str(big.path))
        assert result.returncode == 0, result.stderr
        pid = int(result.stdout.strip())
    try:
        assert os.getpriority(os.PRIO_PROCESS, pid) == 3  # its own, not the guard's
    finally:
        kill_pid(pid)


def test_nice_zero_leaves_every_thread_alone(cgroups: CgroupFactory, store: Path,
                                             tmp_path: Path) -> None:
    cg = cgroups.make("nice0", 256 * MiB)
    config = tmp_path / "nice0.toml"
    config.write_text(f'[daemon]\nnice = 0\n\n[[guard]]\ncgroups = ["{cg.path}"]\n')
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        assert guard.wait_event("guard.started")[0]["nice"] == 0
        guard.wait_event("guard.armed")
        daemon_pid = guard.handle.pid
        assert all(thread_nice(daemon_pid, tid) == 0 for tid in thread_tids(daemon_pid))


def test_a_refused_niceness_is_said_once_and_the_guard_goes_on() -> None:
    """Without CAP_SYS_NICE the kernel refuses: raise_ says why, and stops trying (the daemon
    logs guard.priority_unavailable and runs at the ordinary priority)."""
    calls: list[tuple[int, int, int]] = []

    def refuse(which: int, who: int, nice: int) -> None:
        calls.append((which, who, nice))
        raise PermissionError(1, "Operation not permitted")

    priority = ThreadPriority(-10, setpriority=refuse, setscheduler=lambda *_: None)
    assert not priority.raise_()
    assert priority.error == "niceness -10: Operation not permitted"
    assert not priority.enabled
    assert not priority.raise_() and len(calls) == 1
    priority.lower()
    assert len(calls) == 1
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0


def test_a_daemon_without_cap_sys_nice_says_so_and_guards(cgroups: CgroupFactory, store: Path,
                                                          tmp_path: Path) -> None:
    """Root without CAP_SYS_NICE (a container's root, a unit that drops it): the kernel
    refuses the niceness, the daemon says why, and guards at the ordinary priority."""
    cg = cgroups.make("nocap", 256 * MiB)
    guard = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path),
                          wrapper=("setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"))
    try:
        [unavailable] = guard.wait_event("guard.priority_unavailable")
        assert unavailable["error"].startswith("niceness -10: Permission denied")
        assert guard.wait_event("guard.started")[0]["nice"] == 0
        guard.wait_event("guard.armed")
        daemon_pid = guard.handle.pid
        assert thread_nice(daemon_pid, daemon_pid) == 0
        assert guard.handle.poll() is None
    finally:
        assert guard.stop() == 0
