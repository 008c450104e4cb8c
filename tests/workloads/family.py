"""A parent and two children that count: the workload of the stopped-task tests.

Each child writes its own pid (as it sees it: its PID namespace's) to `LOG.childN.pid`, then
appends its count to `LOG.childN` every `--tick` seconds. The parent holds `--hold` MiB (once
the `--go` file exists, if given) and reaps with waitpid(-1, WUNTRACED | WCONTINUED),
appending what it is told to `LOG.events`: "stopped PID", "continued PID", "exited PID STATUS"
(PIDs as the parent sees them).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def child(log: str, tick: float) -> int:
    with open(f"{log}.pid", "w") as handle:
        handle.write(f"{os.getpid()}\n")
    out = open(log, "a", buffering=1)  # noqa: SIM115 - held open on purpose
    count = 0
    while True:
        count += 1
        out.write(f"{count}\n")
        time.sleep(tick)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--tick", type=float, default=0.02)
    parser.add_argument("--hold", type=int, default=0, help="MiB the parent holds")
    parser.add_argument("--rate", type=float, default=100.0, help="MiB/s while growing")
    parser.add_argument("--go", help="grow only once this file exists")
    args = parser.parse_args()
    for index in range(2):
        if os.fork() == 0:
            os._exit(child(f"{args.log}.child{index}", args.tick))
    events = open(f"{args.log}.events", "a", buffering=1)  # noqa: SIM115
    held: list[bytes] = []

    def grow() -> None:  # beside the waitpid loop, which reports from the start
        while args.go and not os.path.exists(args.go):
            time.sleep(0.05)
        for step in range(args.hold):  # 1 MiB at a time, at --rate
            held.append(bytes([step % 251]) * (1 << 20))
            time.sleep(1 / args.rate)

    threading.Thread(target=grow, daemon=True).start()
    events.write(f"ready {os.getpid()}\n")
    while True:
        try:
            pid, status = os.waitpid(-1, os.WUNTRACED | os.WCONTINUED)
        except ChildProcessError:
            break
        if os.WIFSTOPPED(status):
            events.write(f"stopped {pid}\n")
        elif os.WIFCONTINUED(status):
            events.write(f"continued {pid}\n")
        else:
            events.write(f"exited {pid} {status}\n")
    events.write(f"done {len(held)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
