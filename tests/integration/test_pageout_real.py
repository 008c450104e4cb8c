"""The page-out's parts on the real kernel (issue 29): oomguard's own swap file made, switched
on and removed; a stopped hog in a real memory cgroup paged out with process_madvise, its
memory out of RAM (what its cgroup still holds of it, swap cache, freed by the cgroup's
reclaim); continued, it counts on from where it was with its memory intact.

The swap file exists only for the test's length (the machine has no swap of its own): while it
is on, the kernel may swap other processes too, so it is sized to the hog and removed at once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from oomguard.act.pageout import PageoutError, ProcessPager
from oomguard.act.swapfiles import SwapFiles
from oomguard.sense.procfs import ProcReader
from tests.helpers import (
    CgroupFactory,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    read_counts,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
HOG_MIB = 96


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def _swap_kib(pid: int) -> int:
    return _status_kib(pid, "VmSwap:")


def test_a_stopped_job_is_paged_out_into_a_swap_file_of_ours_and_runs_on_intact(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg = cgroups.make("pageout", 512 * MiB)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=HOG_MIB, rate=400, count=300, tick=0.02))
    swaps = SwapFiles(tmp_path / ".swap")
    made: Path | None = None
    try:
        assert wait_until(lambda: any(c >= HOG_MIB for c in
                                      [int(ln.split()[1]) for ln in _lines(log)]), 30)
        os.kill(hog.pid, signal.SIGSTOP)
        assert wait_until(lambda: proc_state(hog.pid) == "T", 5)
        stopped_at = last_count(log)
        before = cg.snapshot().usage_bytes
        made = swaps.make((HOG_MIB + 32) * MiB)
        assert [a.path for a in swaps.ours()] == [str(made)]
        assert os.stat(made).st_mode & 0o777 == 0o600

        result = ProcessPager().page_out(hog.pid)

        assert result.advised_bytes >= HOG_MIB * MiB
        swapped = _swap_kib(hog.pid) << 10
        assert swapped >= (HOG_MIB - 8) * MiB, (swapped, result)
        assert _status_kib(hog.pid, "RssAnon:") << 10 < 8 * MiB  # out of the process's RAM
        # Written or being written to swap, unmapped: what the cgroup still holds of it is
        # swap cache, which its reclaim frees first (the pageout step makes it: a limit set
        # below usage for a moment on v1, as LimitLifts.lower does).
        cg.set_limit(before - (HOG_MIB - 8) * MiB)
        cg.set_limit(512 * MiB)
        freed = before - cg.snapshot().usage_bytes
        assert freed >= (HOG_MIB - 8) * MiB, (before, freed)
        assert swaps.ours()[0].used > 0
        time.sleep(0.5)
        assert last_count(log) == stopped_at  # still stopped: nothing ran meanwhile

        os.kill(hog.pid, signal.SIGCONT)
        assert wait_until(lambda: "done 300 ok" in log.read_text(), 60), log.read_text()[-300:]
        counts = read_counts(log)
        assert counts == list(range(1, counts[-1] + 1))  # on from where it was, no step lost
        hog.wait(10)
        swaps.remove(made)
        assert swaps.ours() == [] and not made.exists()
        made = None
    finally:
        kill_pid(hog.pid)
        if made is not None:
            swaps.remove(made)


def test_a_running_job_is_not_paged_out(cgroups: CgroupFactory, tmp_path: Path) -> None:
    cg = cgroups.make("running", 256 * MiB)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=400, count=100000, tick=0.02))
    try:
        assert wait_until(lambda: read_counts(log), 30)
        with pytest.raises(PageoutError, match="is not stopped"):
            ProcessPager().page_out(hog.pid)
        assert ProcReader().state(hog.pid) in ("R", "S")
    finally:
        kill_pid(hog.pid)


def _lines(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln[:1].isdigit()] \
        if log.exists() else []
