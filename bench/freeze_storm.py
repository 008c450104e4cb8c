"""The freeze of a fork storm, connector against /proc re-listing: tests/workloads/forkstorm.py
(~1000 children a second, no growth) is frozen and thawed N times each way, alternating;
prints freeze() (every SIGSTOP sent) and freeze() + wait_frozen() (every task seen stopped,
checked) in milliseconds, the tasks frozen and the forks caught on their event. As root:

    .venv/bin/python -m bench.freeze_storm [RUNS]

Not part of `python -m bench` (no CRIU, no cgroup): a check of the freezer alone."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from oomguard.act.freezer import SigstopFreezer
from oomguard.sense.cnproc import FORKS
from oomguard.sense.procevents import EventSource, Subscriber
from tests.helpers import REPO

STORM = REPO / "tests" / "workloads" / "forkstorm.py"


def _refused() -> EventSource:
    raise PermissionError(1, "the connector left out on purpose")


def one_freeze(connector: bool, log: Path) -> tuple[float, float, int, int]:
    storm = subprocess.Popen([sys.executable, str(STORM), str(log), "0", "1000", "60"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(1.0)  # the storm at full rate
        freezer = SigstopFreezer(events=Subscriber(kinds=FORKS) if connector
                                 else Subscriber(_refused))
        freezer.events.probe()  # pyroute2 loaded and the answer known, as in the daemon
        start = time.perf_counter()
        frozen = freezer.freeze(storm.pid)
        sent = time.perf_counter()
        done = freezer.wait_frozen(frozen, 10.0)
        checked = time.perf_counter()
        if not done.stopped:
            raise RuntimeError("the storm did not stop within 10 s")
        return (sent - start) * 1e3, (checked - start) * 1e3, len(done.pids), done.caught
    finally:
        os.killpg(storm.pid, signal.SIGKILL)
        storm.wait()


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    found: dict[str, list[tuple[float, float, int, int]]] = {"connector": [], "proc": []}
    with tempfile.TemporaryDirectory() as work:
        for index in range(runs):
            for mode in found:
                log = Path(work) / f"storm-{mode}-{index}.log"
                found[mode].append(one_freeze(mode == "connector", log))
    for mode, rows in found.items():
        sent, checked, tasks, caught = zip(*rows, strict=True)
        print(f"{mode:9s} SIGSTOPs sent: median {statistics.median(sent):.1f} ms, max "
              f"{max(sent):.1f}; stopped and checked: median {statistics.median(checked):.1f} "
              f"ms, max {max(checked):.1f}; tasks median {statistics.median(tasks):.0f}; forks "
              f"caught on their event: {sum(caught)} in {runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
