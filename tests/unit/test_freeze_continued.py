"""A task that another process continues after oomguard's SIGSTOP (tmux continues its pane's
program) is named, and the freeze does not wait for it: on a fake /proc (the kernel's pending
set and thread states, each case) and on real processes (a parent that continues its stopped
child, as tmux does), with the kernel's process events and without."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.act.freezer import SigstopFreezer
from oomguard.act.frozen import continued
from oomguard.sense.procevents import EventSource, Subscriber
from oomguard.sense.procfs import PF_EXITING, ProcReader
from tests.unit._support import USER_FLAGS, stat_line

SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)


def fake(root: Path, pid: int, threads: dict[int, str], pending: int = 0,
         shared: int = 0, flags: int = USER_FLAGS) -> None:
    base = root / str(pid)
    base.mkdir(parents=True)
    (base / "stat").write_text(stat_line(pid, "hog", threads[pid], 1, flags=flags))
    (base / "status").write_text(f"Name:\thog\nPid:\t{pid}\nUid:\t0\t0\t0\t0\nSigPnd:\t"
                                 f"{pending:016x}\nShdPnd:\t{shared:016x}\n")
    for tid, state in threads.items():
        (base / "task" / str(tid)).mkdir(parents=True)
        (base / "task" / str(tid) / "stat").write_text(stat_line(tid, "hog", state, 1))


@pytest.mark.parametrize(
    ("threads", "shared", "expected"),
    [
        ({10: "R"}, 0, True),  # no stop pending, running: someone continued it
        ({10: "S", 11: "R"}, 0, True),
        ({10: "R"}, SIGSTOP_BIT, False),  # not yet scheduled to take its SIGSTOP
        ({10: "D"}, SIGSTOP_BIT, False),  # in the kernel at the memory limit
        ({10: "T", 11: "R"}, 0, False),  # a group stop on its way: one thread took it
        ({10: "t"}, 0, False),  # stopped by its tracer
    ],
    ids=["continued", "continued-threads", "not-yet", "at-the-limit", "group-stop", "traced"],
)
def test_continued_is_told_from_not_yet_stopped(tmp_path: Path, threads: dict[int, str],
                                                shared: int, expected: bool) -> None:
    fake(tmp_path, 10, threads, shared=shared)
    assert continued(ProcReader(tmp_path), 10) is expected


def test_a_task_on_its_way_out_was_not_continued(tmp_path: Path) -> None:
    """A kill discards its stop signal; it ends in a moment (the OOM killer's victim)."""
    fake(tmp_path, 10, {10: "R"}, flags=USER_FLAGS | PF_EXITING)
    assert continued(ProcReader(tmp_path), 10) is False


def test_a_gone_task_was_not_continued(tmp_path: Path) -> None:
    assert continued(ProcReader(tmp_path), 99) is False


# The parent continues its child whenever it stops, as tmux's server does a pane's program.
CONTINUER = """
import os, signal, sys, time
pid = os.fork()
if pid == 0:
    while True:
        time.sleep(0.005)
print(pid, flush=True)
while True:
    _, status = os.waitpid(pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        break
    os.kill(pid, signal.SIGCONT)
    print("continued", flush=True)
"""


@pytest.fixture
def continuer() -> Iterator[tuple[subprocess.Popen[str], int]]:
    parent = subprocess.Popen([sys.executable, "-c", CONTINUER], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        yield parent, child
    finally:
        for pid in (child, parent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def _unavailable() -> EventSource:
    raise PermissionError(1, "Operation not permitted")


@pytest.mark.parametrize("connector", [True, False], ids=["connector", "listing"])
def test_a_task_its_parent_continues_is_named_and_not_waited_for(
        continuer: tuple[subprocess.Popen[str], int], connector: bool) -> None:
    """As in the daemon, where the headroom and the ledger come between the SIGSTOPs and the
    wait, the parent's SIGCONT comes before the wait looks. (One that comes after the wait has
    seen the task stopped is not seen: the dump takes the task all the same.)"""
    parent, child = continuer
    freezer = SigstopFreezer() if connector else SigstopFreezer(
        events=Subscriber(_unavailable))
    began = time.monotonic()
    frozen = freezer.freeze(child)
    assert parent.stdout is not None and select.select([parent.stdout], [], [], 5.0)[0]
    assert parent.stdout.readline().strip() == "continued"
    frozen = freezer.wait_frozen(frozen, timeout=5.0)
    waited = time.monotonic() - began
    assert waited < 2.0, f"waited {waited:.2f}s for a task its parent continues"
    assert frozen.stopped is True
    [named] = frozen.not_held
    assert named["pid"] == child and named["comm"] == ProcReader().stat(child).comm
    assert str(named["why"]).startswith("continued by another process after SIGSTOP; its "
                                        f"parent {parent.pid} ("), named
    assert frozen.fields()["not_held"] == frozen.not_held
    assert ProcReader().state(child) != "T"  # it runs on (CRIU's seize would hold it)


def test_a_task_nobody_continues_is_held_and_not_named() -> None:
    job = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        freezer = SigstopFreezer()
        frozen = freezer.wait_frozen(freezer.freeze(job.pid), timeout=5.0)
        assert frozen.stopped is True and frozen.not_held == []
        assert "not_held" not in frozen.fields()
        assert ProcReader().state(job.pid) == "T"
    finally:
        job.kill()
        job.wait()
