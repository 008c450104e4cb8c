"""Lazy restore against eager restore, on the same checkpoint in the same run, for 256 MiB,
1 GiB and 2 GiB (tests/workloads/scanner.py: a job that keeps reading all of its memory and
beats every 2 ms). For each: the time from the command to the job's first beat (it runs again),
the restore's own time (its first check to the tree running, without the CLI's start), the time
to every page resident (the keeper's lazy.json), and the job's slowdown while pages stream in
(its first pass over its memory after the restore, against the median pass before the dump).
Each restore is asked three times of the same checkpoint, the job killed in between: lazily by
the CLI acting on the store itself (as root without a daemon: it starts Python, loads oomguard,
finds CRIU and probes userfaultfd first), lazily through a running daemon (the CLI only asks),
then eagerly by the CLI (`--force`); the page cache is dropped before each."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import Daemon, cli_result
from tests.helpers import REPO, CgroupFactory, kill_pid, wait_until

SCANNER = REPO / "tests" / "workloads" / "scanner.py"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _passes(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(path) if line.startswith("{")]


def _drop(images: Path) -> None:
    import os

    for path in images.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _one_restore(store: Path, checkpoint_id: str, cgroup: Path, logs: list[Path],
                 beats: list[Path], before_pass: float, lazy: bool,
                 socket: Path | None = None) -> dict[str, Any]:
    _drop(store / checkpoint_id / "images")
    beats_before = [len(_lines(b)) for b in beats]
    passes_before = [len(_passes(log)) for log in logs]
    (store / checkpoint_id / "lazy.json").unlink(missing_ok=True)
    command_at = time.time()
    done, _ = cli_result(store, "restore", *(["--lazy"] if lazy else []), "--force",
                         checkpoint_id, "--cgroup", str(cgroup), socket=socket)
    returned = time.time() - command_at

    def first_beats() -> list[float] | None:
        found = [_lines(b) for b in beats]
        if any(len(f) <= n for f, n in zip(found, beats_before, strict=True)):
            return None
        return [float(f[n]) for f, n in zip(found, beats_before, strict=True)]

    def new_passes() -> list[list[dict[str, Any]]] | None:
        """Passes begun after the command (the one the dump interrupted is not one)."""
        found = [[x for x in _passes(log)[n:] if x["start"] >= command_at]
                 for log, n in zip(logs, passes_before, strict=True)]
        return found if all(len(f) >= 3 for f in found) else None

    running = wait_until(first_beats, 30)
    passes = wait_until(new_passes, 180)
    first = [p[0]["end"] - p[0]["start"] for p in passes] if passes else []
    row: dict[str, Any] = {
        "mode": ("lazy" if lazy else "eager") + (" (daemon)" if socket else ""),
        "lazy": done.get("lazy"),
        # every process of the job has run again (its first beat after the command)
        "command_to_running_s": round(max(running) - command_at, 3) if running else None,
        "restore_s": done.get("total_s"), "cli_returned_s": round(returned, 3),
        "first_pass_s": round(max(first), 3) if first else None,
        "slowdown": round(max(first) / before_pass, 2) if first else None,
        "intact": bool(passes) and all(x["intact"] for p in passes for x in p),
    }
    if lazy:
        path = store / checkpoint_id / "lazy.json"
        status = wait_until(lambda: path.exists() and json.loads(path.read_text()), 120)
        if status:
            row["resident_s"] = round(status.get("resident_at", 0) - command_at, 3)
            row["verified_s"] = round(status.get("verified_at", 0) - command_at, 3)
            row["outcome"] = status.get("outcome")
    else:
        row["resident_s"] = row["restore_s"]  # eager: every page is in before it runs
    return row


def one_size(factory: CgroupFactory, work: Path, mib: int, processes: int,
             index: int) -> list[dict[str, Any]]:
    """`processes` scanners of `mib // processes` MiB each under one shell (the tree)."""
    name = f"lz{mib}-{index}"
    cgroup = factory.make(name, None)
    target = factory.make(f"{name}r", None)
    store = work / f"store-{name}"
    logs = [work / f"{name}-{i}.passes" for i in range(processes)]
    beats = [work / f"{name}-{i}.beats" for i in range(processes)]
    for path in logs + beats:
        path.unlink(missing_ok=True)
    jobs = " ".join(f"{sys.executable} {SCANNER} --mib {mib // processes} --log {log} "
                    f"--beats {beat} &" for log, beat in zip(logs, beats, strict=True))
    proc = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > "$0"; {jobs} wait',
                             str(cgroup.path / "cgroup.procs")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    rows = []
    config = work / f"{name}.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\n')
    daemon = Daemon(store, config, work / f"{name}.daemon.log")
    daemon.start()
    try:
        if not wait_until(lambda: all(len(_passes(log)) >= 3 for log in logs), 180):
            raise RuntimeError(f"{name}: the scanners did not start passing")
        before = max(statistics.median(p["end"] - p["start"] for p in _passes(log)[1:])
                     for log in logs)
        done, _ = cli_result(store, "checkpoint", str(proc.pid), "--reason", "benchmark")
        proc.wait(timeout=30)
        dumped = [int(x) for x in json.loads((store / done["id"] / "meta.json").read_text())
                  ["pids"]]
        for lazy, socket in ((True, None), (True, daemon.socket), (False, None)):
            # CRIU needs the PIDs back: their zombies are reaped by init, in its time (seconds
            # on this VM), which the restore would wait for: not what is measured here.
            wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in dumped), 30)
            row = _one_restore(store, done["id"], target.path, logs, beats, before, lazy,
                               socket)
            row.update(mib=mib, processes=processes, image_bytes=done["image_bytes"],
                       pass_before_s=round(before, 3))
            rows.append(row)
            for pid in target.procs():
                kill_pid(pid)
            wait_until(lambda: not target.procs(), 10)
    finally:
        daemon.stop()
        for pid in target.procs() + cgroup.procs():
            kill_pid(pid)
        shutil.rmtree(store, ignore_errors=True)
    return rows


def lazy_restore(factory: CgroupFactory, work: Path, sizes: list[tuple[int, int]],
                 repeats: int) -> list[dict[str, Any]]:
    return [row for index in range(repeats) for mib, processes in sizes
            for row in one_size(factory, work, mib, processes, index)]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per size and mode."""
    out = []
    for mib in sorted({r["mib"] for r in rows}):
        for mode in ("lazy", "lazy (daemon)", "eager"):
            group = [r for r in rows if r["mib"] == mib and r["mode"] == mode]
            if not group:
                continue
            med = {key: statistics.median(r[key] for r in group if r.get(key) is not None)
                   for key in ("command_to_running_s", "restore_s", "resident_s",
                               "first_pass_s", "slowdown", "pass_before_s")
                   if any(r.get(key) is not None for r in group)}
            out.append({"mib": mib, "mode": mode, "runs": len(group),
                        "intact": all(r["intact"] for r in group), **med})
    return out

