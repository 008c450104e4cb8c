"""`python -m bench`: every benchmark in one run (scripts/bench), results as JSON, a markdown
table and PNG plots in --out. Not part of the tests' pass/fail: it measures, it does not judge.

    .venv/bin/python -m bench [--out bench/results] [--quick] [--only latency,idle]
Needs root, the cgroup v1 memory controller (this machine's) and CRIU (scripts/setup)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.compress import compression
from bench.harness import cgroup_factory, machine
from bench.idle import idle_cost
from bench.latency import contended_latency, detection_latency, scale_latency
from bench.lazy import lazy_restore
from bench.report import write_report
from bench.saverate import UNTHROTTLED, save_rate
from bench.throughput import throughput
from bench.undumpable import undumpable
from bench.victims import victim_choice

PARTS = ("latency", "contended", "saverate", "throughput", "lazy", "compress", "idle", "scale",
         "victims", "undumpable")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--earlyoom", type=Path,
                        help="earlyoom binary for the idle and undumpable comparisons")
    parser.add_argument("--quick", action="store_true", help="few runs: checks the harness")
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp"),
                        help="where checkpoints and disk baselines go (its filesystem is measured)")
    args = parser.parse_args()
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    quick = args.quick
    runs = 3 if quick else 10
    latency_runs = 3 if quick else 20  # the p95 of 20 is the 19th, not the largest
    results: dict[str, Any] = {}
    previous = args.out / "results.json"
    if set(parts) != set(PARTS) and previous.exists():
        # A partial run updates its parts in the last full results (noted in "partial").
        results = json.loads(previous.read_text())
        results.setdefault("partial", []).append({"parts": parts, "date": time.ctime()})
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="oomguard-bench-", dir=args.work) as tmp, \
            cgroup_factory("oomguard-bench") as factory:
        work = Path(tmp)
        results["machine"] = machine(work)

        def timed(name: str, fn: Any, *fn_args: Any) -> None:
            if name not in parts:
                return
            start = time.monotonic()
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            try:
                results[name] = fn(factory, work, *fn_args)
            except Exception as exc:  # one part's failure keeps the others' figures
                traceback.print_exc()
                results.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
            results.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)
            print(f"bench: {name} done in {time.monotonic() - start:.0f} s", file=sys.stderr,
                  flush=True)
            factory.cleanup()
            factory.created.clear()

        timed("latency", detection_latency, [100, 500, 2000], latency_runs)
        timed("contended", contended_latency, 500, latency_runs)
        timed("saverate", save_rate, [100, 500, 2000, UNTHROTTLED], 3 if quick else 10)
        sizes = [(256, 1), (1024, 1)] if quick else [(256, 1), (1024, 1), (2048, 2)]
        timed("throughput", throughput, sizes, 1 if quick else 3)
        timed("lazy", lazy_restore, sizes, 1 if quick else 3)
        timed("compress", compression, [256] if quick else [256, 1024], 1 if quick else 2)
        timed("idle", idle_cost, [1, 100, 1000] if not quick else [1, 10],
              10.0 if quick else 60.0, args.earlyoom)
        timed("scale", scale_latency, [100, 500, 2000], latency_runs, 100 if quick else 1000)
        timed("victims", victim_choice, 1000 if quick else 10_000, runs)
        timed("undumpable", undumpable, 2 if quick else 5, args.earlyoom)
    results.setdefault("seconds", {})["total"] = round(time.monotonic() - began, 1)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, args.out)
    print(f"bench: wrote {args.out}/results.json, results.md and plots in "
          f"{results['seconds']['total']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
