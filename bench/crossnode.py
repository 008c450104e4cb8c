"""Cross-node resume (issue 28): how long a job that outgrew node A takes to run again on node
B, in the two-node lane (scripts/cluster-lane: two VMs, Slurm, the store on NFS exported by
node A), split into its parts:

- dump: oomguard on A, from the threshold crossed to the checkpoint committed in the shared
  store (stop, CRIU's dump over NFS, fsync and rename), with CRIU's own dump time and rate;
- requeue and scheduling: from the checkpoint committed on A to the requeued job's batch
  script starting on B (oomguard's `scontrol requeue` and the new limit, Slurm's requeue
  delay and its scheduler);
- restore over NFS: from the batch script's start on B to the job running again there
  (`oomguard resume-job` asking B's daemon, which reads the images over NFS).

Baselines from the same run: the store's write rate from node A (`dd` of a file of the job's
checkpointed size, fsync'd) and its read rate from node B (`cat` of that file, caches
dropped first); the dump's and the restore's rates are given as ratios of them. The nodes set
their clocks from the host's at boot; each one's remaining offset is reported.

    python3 bench/crossnode.py run [--runs N] [--mem-mib M] [--grow F] [--out FILE]
        runs `scripts/cluster-lane run --timings` N times (as root, after scripts/setup) and
        appends a table, with the date and the commit, to FILE
        (default bench/results/crossnode.md).
    python3 bench/crossnode.py collect DIR
        one run's figures, as JSON, from the lane's shared directory (scripts/cluster-lane).

Stdlib only. Not a test: it measures, it does not judge."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def events(path: Path) -> list[dict[str, Any]]:
    """The JSON events of one log (other lines skipped)."""
    found = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                found.append(event)
    return found


def first(found: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for event in found:
        if event.get("event") == name:
            return event
    raise LookupError(f"no {name!r} event")


def when(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def collect(shared: Path) -> dict[str, Any]:
    """One run's figures from the lane's shared directory."""
    a = events(shared / "log" / "oomguard-nodea.log")
    b = events(shared / "log" / "oomguard-nodeb.log")
    crossed, done = first(a, "threshold.crossed"), first(a, "checkpoint.done")
    restored = first(b, "restore.done")
    batch_start = float((shared / "t-batch-start").read_text().split()[0])
    write = json.loads((shared / "bench-write.json").read_text())
    read = json.loads((shared / "bench-read.json").read_text())
    clocks = json.loads((shared / "host-clocks.json").read_text())
    image = int(done["image_bytes"])
    dump_mibs = image / MiB / float(done["dump_s"])
    restore_s = when(restored) - batch_start
    restore_mibs = image / MiB / float(restored["seconds"])
    write_mibs = write["bytes"] / MiB / float(write["seconds"])
    read_mibs = read["bytes"] / MiB / float(read["seconds"])
    return {
        "result": (shared / "result").read_text().strip(),
        "image_mib": round(image / MiB, 1),
        "dump_s": round(when(done) - when(crossed), 3),
        "criu_dump_s": float(done["dump_s"]),
        "dump_mib_s": round(dump_mibs, 1),
        "requeue_and_scheduling_s": round(batch_start - when(done), 3),
        "restore_s": round(restore_s, 3),
        "criu_restore_s": float(restored["seconds"]),
        "restore_mib_s": round(restore_mibs, 1),
        "total_s": round(when(restored) - when(crossed), 3),
        "nfs_write_mib_s": round(write_mibs, 1),
        "nfs_read_mib_s": round(read_mibs, 1),
        "dump_vs_nfs_write": round(dump_mibs / write_mibs, 2),
        "restore_vs_nfs_read": round(restore_mibs / read_mibs, 2),
        "clock_offsets_ms": {node: round((c["node"] - c["host"]) * 1000, 1)
                             for node, c in clocks.items()},
    }


ROWS = (("image checkpointed (MiB)", "image_mib"),
        ("dump: threshold to committed (s)", "dump_s"),
        ("  of it CRIU's dump (s)", "criu_dump_s"),
        ("  CRIU's dump rate (MiB/s)", "dump_mib_s"),
        ("requeue and scheduling: committed on A to the batch script on B (s)",
         "requeue_and_scheduling_s"),
        ("restore over NFS: batch script on B to the job running (s)", "restore_s"),
        ("  of it CRIU's restore (s)", "criu_restore_s"),
        ("  CRIU's restore rate (MiB/s)", "restore_mib_s"),
        ("total: threshold on A to running on B (s)", "total_s"),
        ("baseline: store write rate from A, dd + fsync (MiB/s)", "nfs_write_mib_s"),
        ("baseline: store read rate from B, cold cat (MiB/s)", "nfs_read_mib_s"),
        ("dump rate / store write rate", "dump_vs_nfs_write"),
        ("restore rate / store read rate", "restore_vs_nfs_read"))


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| figure | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |",
             "|---|" + "---|" * (len(runs) + 1)]
    for label, key in ROWS:
        values = [float(r[key]) for r in runs]
        lines.append(f"| {label} | " + " | ".join(f"{v:g}" for v in values)
                     + f" | {statistics.median(values):g} |")
    offsets = "; ".join(", ".join(f"{n} {ms:+g} ms" for n, ms in r["clock_offsets_ms"].items())
                        for r in runs)
    lines.append("")
    lines.append(f"Node clocks against the host's after setting them: {offsets} (each includes "
                 "the delay of the 9p write that measured it: an upper bound).")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            began = time.monotonic()
            lane = subprocess.run(
                [str(REPO / "scripts" / "cluster-lane"), "run", "--timeout", str(args.timeout),
                 "--mem-mib", str(args.mem_mib), "--grow", str(args.grow),
                 "--timings", out.name], cwd=REPO, stdin=subprocess.DEVNULL, check=False)
            print(f"crossnode: run {i + 1}: exit {lane.returncode}, "
                  f"{time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
            if lane.returncode != 0:
                return lane.returncode
            runs.append(json.loads(Path(out.name).read_text()))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    text = (f"\n## {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, commit {commit} "
            f"(bench/crossnode.py run --runs {args.runs} --mem-mib {args.mem_mib} "
            f"--grow {args.grow})\n\n"
            f"Job `--mem={args.mem_mib}M`, guarded at 80% (where it was caught: the image "
            "size); two TCG VMs (1 vCPU each), the store on NFS 4.2 exported by node A.\n\n"
            + table(runs) + "\n")
    print(text)
    with args.out.open("a") as handle:
        handle.write(text)
    (args.out.with_suffix(".json")).write_text(json.dumps(runs, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/crossnode.py")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--runs", type=int, default=2)
    r.add_argument("--mem-mib", type=int, default=1280, help="the job's --mem: 1280 is a 1 GiB "
                   "checkpoint at 80%%")
    r.add_argument("--grow", type=float, default=2.0, help="the job grows to 1.25 x --mem-mib: "
                   "over 1.5625, so that on node B it stays under 80%% of its grown limit")
    r.add_argument("--timeout", type=int, default=2400)
    r.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "crossnode.md")
    args = parser.parse_args()
    if args.command == "collect":
        print(json.dumps(collect(args.dir), indent=1))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
