"""oomguard.act.freezer and the restore hook's continue: a task the user had stopped is noted
before oomguard's SIGSTOP and never continued by it (real child processes of this test)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.criu import KEEP_STOPPED_ENV, hook_script_text
from oomguard.act.freezer import SigstopFreezer
from oomguard.act.frozen import Frozen
from oomguard.sense.procfs import ProcReader
from oomguard.store.criu_hook import continue_tree, hung_up_at_exit, ns_pid, parse_keep
from tests.helpers import REPO

FORKSTORM = REPO / "tests" / "workloads" / "forkstorm.py"
VFORKER = REPO / "tests" / "workloads" / "vforker.c"


def _state(pid: int) -> str:
    return ProcReader().state(pid)


def _until(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def family() -> Iterator[tuple[int, list[int]]]:
    """A shell with two sleeping children: (root, [child, child])."""
    root = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & sleep 60 & wait"],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    proc = ProcReader()
    assert _until(lambda: len(proc.children_of(root.pid)) == 2)
    kids = sorted(proc.children_of(root.pid))
    try:
        yield root.pid, kids
    finally:
        for pid in (*kids, root.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.wait()


def test_frozen_ours_leaves_out_the_users() -> None:
    frozen = Frozen([1, 2, 3], [3])
    assert frozen.ours == [1, 2]
    assert frozen.plus_user_stopped([2, 3]) == Frozen([1, 2, 3], [3, 2])
    assert frozen.plus_user_stopped([3]) is frozen
    assert Frozen([1]).ours == [1]


def test_a_freeze_that_times_out_names_the_threads_it_waited_for(tmp_path: Path) -> None:
    """A task whose SIGSTOP cannot take yet (here: a parent held in the kernel until its vfork
    child execs; in life, one in D at the limit or sleeping out a memory.high penalty) is
    named in victim.frozen, with its state and where it sleeps."""
    binary = tmp_path / "vforker"
    subprocess.run(["gcc", "-O1", "-o", str(binary), str(VFORKER)], check=True)
    parent = subprocess.Popen([str(binary)], stdout=subprocess.PIPE, start_new_session=True)
    proc = ProcReader()
    freezer = SigstopFreezer()
    frozen = None
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"up\n"
        assert _until(lambda: proc.children_of(parent.pid) and _state(parent.pid) == "D")
        frozen = freezer.wait_frozen(freezer.freeze(parent.pid), 0.3)
        assert frozen.stopped is False
        assert [(t["pid"], t["state"]) for t in frozen.unstopped] == [(parent.pid, "D")], \
            frozen.unstopped
        # (wait_for_vfork_done, where the kernel did not inline it into kernel_clone)
        assert frozen.unstopped[0]["wchan"] in ("kernel_clone", "wait_for_vfork_done"), \
            frozen.unstopped
        told = frozen.fields()
        assert told["all_stopped"] is False and told["unstopped"] == frozen.unstopped
    finally:
        if frozen is not None:
            freezer.thaw(frozen.ours)
        for pid in [*proc.children_of(parent.pid), parent.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
    assert "unstopped" not in Frozen([1], stopped=True).fields()


def test_a_task_found_stopped_gets_no_sigstop_and_no_sigcont(
        family: tuple[int, list[int]]) -> None:
    root, (user_stopped, running) = family
    os.kill(user_stopped, signal.SIGSTOP)
    assert _until(lambda: _state(user_stopped) == "T")
    freezer = SigstopFreezer()
    frozen = freezer.freeze(root)
    assert sorted(frozen.pids) == sorted([root, user_stopped, running])
    assert frozen.user_stopped == [user_stopped]
    assert freezer.wait_frozen(frozen, 5.0).stopped
    assert freezer.stopped_again(frozen.ours) == []
    freezer.thaw(frozen.ours)
    assert _until(lambda: _state(root) != "T" and _state(running) != "T")
    assert _state(user_stopped) == "T"


def test_a_job_the_user_stopped_whole_is_all_left_stopped(
        family: tuple[int, list[int]]) -> None:
    """Ctrl-Z on the whole job: nothing to stop, nothing to continue, and not 'gone'."""
    root, kids = family
    for pid in (root, *kids):
        os.kill(pid, signal.SIGSTOP)
    assert _until(lambda: all(_state(p) == "T" for p in (root, *kids)))
    frozen = SigstopFreezer().freeze(root)
    assert sorted(frozen.user_stopped) == sorted([root, *kids]) and frozen.ours == []


def test_tasks_held_are_ours_even_when_found_stopped(family: tuple[int, list[int]]) -> None:
    """A chain's freeze step stopped them: the checkpoint's own freeze must not take them
    for the user's."""
    root, kids = family
    freezer = SigstopFreezer()
    first = freezer.freeze(root)
    assert freezer.wait_frozen(first, 5.0).stopped
    again = freezer.freeze(root, held=first.ours)
    assert again.user_stopped == [] and sorted(again.ours) == sorted([root, *kids])
    again = freezer.wait_frozen(again, 5.0)
    # No second SIGSTOP: it would stay pending and read as the user's stop.
    assert freezer.stopped_again(again.ours) == []
    freezer.thaw(again.ours)


def test_a_stop_sent_while_oomguard_holds_the_task_is_the_users(
        family: tuple[int, list[int]]) -> None:
    """The race: the user stops a task after oomguard's scan (or while it holds it). The
    second stop signal stays pending in a stopped task: that is how it is recognised."""
    root, (late, other) = family
    freezer = SigstopFreezer()
    frozen = freezer.freeze(root)
    assert freezer.wait_frozen(frozen, 5.0).stopped
    os.kill(late, signal.SIGSTOP)  # the user's, a moment too late for the scan
    assert _until(lambda: ProcReader().status(late).stop_pending)
    assert freezer.stopped_again(frozen.ours) == [late]
    frozen = frozen.plus_user_stopped([late])
    freezer.thaw(frozen.ours)
    assert _until(lambda: _state(other) != "T")
    assert _state(late) == "T"


def test_parse_keep() -> None:
    assert parse_keep("") == set()
    assert parse_keep("3,17, 4") == {3, 4, 17}
    assert parse_keep("3,x,-1,,") == {3}


def test_continue_tree_leaves_the_users_tasks_stopped(family: tuple[int, list[int]]) -> None:
    root, (keep, other) = family
    for pid in (root, keep, other):
        os.kill(pid, signal.SIGSTOP)
    assert _until(lambda: all(_state(p) == "T" for p in (root, keep, other)))
    inner = ns_pid(keep)
    assert inner is not None
    count, kept = continue_tree(root, {inner})
    assert (count, kept) == (2, [keep])
    assert _until(lambda: _state(root) != "T" and _state(other) != "T")
    assert _state(keep) == "T"


def _post_resume(script: Path, root: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script)], capture_output=True, text=True, timeout=10,
                          env={"PATH": "/usr/bin:/bin", "CRTOOLS_SCRIPT_ACTION": "post-resume",
                               "CRTOOLS_INIT_PID": root, **env})


def _hook(tmp_path: Path, python: str) -> Path:
    script = tmp_path / "hook"
    script.write_text(hook_script_text(python))
    script.chmod(0o700)
    return script


def test_the_hook_continues_a_whole_tree_without_python(tmp_path: Path) -> None:
    """With no task to keep stopped, the action script's shell continues the tree itself (a
    root, its children and a grandchild, all stopped): its Python here is /bin/false, which
    would fail the action had it run."""
    root = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & (sleep 60 & wait) & wait"],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    proc = ProcReader()
    try:
        assert _until(lambda: len(proc.descendants(root.pid)) == 4)
        tree = proc.descendants(root.pid)
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)
        assert _until(lambda: all(_state(p) == "T" for p in tree))
        done = _post_resume(_hook(tmp_path, "/bin/false"), str(root.pid))
        assert (done.returncode, done.stderr) == (0, "")
        assert _until(lambda: not any(_state(p) == "T" for p in tree))
    finally:
        for pid in reversed(proc.descendants(root.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.wait()


def test_the_hook_leaves_no_stopped_task_to_the_shell(family: tuple[int, list[int]],
                                                      tmp_path: Path) -> None:
    """Tasks the user had stopped: the action script hands the continue to the hook's Python,
    which leaves them so; a pid that is not a number, or gone, continues nothing and fails
    nothing."""
    root, (keep, other) = family
    for pid in (root, keep, other):
        os.kill(pid, signal.SIGSTOP)
    assert _until(lambda: all(_state(p) == "T" for p in (root, keep, other)))
    script = _hook(tmp_path, sys.executable)
    for bad in ("", "1; kill -STOP 1", "999999999"):
        assert _post_resume(script, bad).returncode == 0
    assert all(_state(p) == "T" for p in (root, keep, other))
    done = _post_resume(script, str(root), **{KEEP_STOPPED_ENV: str(ns_pid(keep))})
    assert done.returncode == 0, done.stderr
    assert _until(lambda: _state(root) != "T" and _state(other) != "T")
    assert _state(keep) == "T"


def test_a_task_the_kernel_would_hang_up_is_not_kept_stopped() -> None:
    """A group leader in our session, in a group of its own: were this process (standing in
    for CRIU) to exit with it stopped, the kernel would send the orphaned group SIGHUP."""
    job = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, process_group=0)
    try:
        assert hung_up_at_exit(job.pid, job.pid)
        own_session = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        try:
            assert not hung_up_at_exit(own_session.pid, own_session.pid)
        finally:
            own_session.kill()
            own_session.wait()
    finally:
        job.kill()
        job.wait()


def test_a_real_fork_storm_is_stopped_whole_and_continues_after_the_thaw(
        tmp_path: Path) -> None:
    """~1000 children a second on the real kernel (tests/workloads/forkstorm.py, no growth):
    after the wait, every live process of the storm is stopped and in the frozen tree; the
    thaw lets it go on. Uses the connector where this machine offers it."""
    log = tmp_path / "storm.log"
    storm = subprocess.Popen([sys.executable, str(FORKSTORM), str(log), "0", "1000", "60"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert _until(lambda: log.exists() and log.read_text().count("start") > 200, 30)
        freezer = SigstopFreezer()
        done = freezer.wait_frozen(freezer.freeze(storm.pid), 10.0)
        assert done.stopped and done.left == []
        if freezer.events.why_not is None:
            assert done.method == "connector"
        live = [pid for pid in storm_pids(str(log)) if _state(pid) not in ("Z", "X")]
        assert live and all(_state(pid) == "T" for pid in live), {p: _state(p) for p in live}
        assert set(live) <= set(done.pids)
        size = log.stat().st_size
        time.sleep(0.3)
        assert log.stat().st_size == size  # nothing of it runs
        freezer.thaw(done.ours)
        assert _until(lambda: log.stat().st_size > size + 1000, 30)
    finally:
        os.killpg(storm.pid, signal.SIGKILL)
        storm.wait()


def storm_pids(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@pytest.mark.parametrize("connector", [True, False])
def test_a_task_the_freeze_finds_is_in_the_ledger_before_its_sigstop(
        family: tuple[int, list[int]], tmp_path: Path, connector: bool) -> None:
    """Record-before-act: the tree was recorded as chosen (its root alone here: the children
    stand for forks since); each task the freeze finds is noted in the frozen ledger before
    its SIGSTOP, so a daemon killed between the two leaves nothing stopped unrecorded. The
    root, recorded already, costs no second write."""
    from oomguard.sense.procevents import Subscriber
    from oomguard.store.ledger import FrozenLedger

    root, kids = family
    ledger = FrozenLedger(tmp_path / "frozen.json")
    ledger.record([root])
    writes: list[list[int]] = []
    stops: list[tuple[int, bool]] = []

    def note(pids: list[int]) -> None:
        writes.append([p for p in pids if p not in ledger._noted])
        ledger.note(pids)

    def kill(pid: int, sig: int) -> None:
        if sig == signal.SIGSTOP:
            stops.append((pid, pid in ledger.recorded([pid])))
        os.kill(pid, sig)
    def unavailable() -> Any:
        raise PermissionError(1, "Operation not permitted")
    events = Subscriber() if connector else Subscriber(unavailable)
    freezer = SigstopFreezer(events=events, kill=kill, before_stop=note)
    frozen = freezer.wait_frozen(freezer.freeze(root), 5.0)
    assert frozen.stopped and sorted(frozen.pids) == sorted([root, *kids])
    assert sorted(pid for pid, _ in stops) == sorted([root, *kids])
    assert all(recorded for _, recorded in stops), stops
    assert sorted(pid for batch in writes for pid in batch) == sorted(kids)  # not the root
    freezer.thaw(frozen.ours)
    ledger.clear(frozen.pids)
    assert ledger.recorded([root, *kids]) == [] and not ledger._noted
