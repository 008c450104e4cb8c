"""The benchmark results as a markdown report with PNG plots (matplotlib, headless)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def _by_size(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    grouped: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(int(row["mib"]), []).append(row)
    return grouped


def ratios(results: dict[str, Any]) -> list[str]:
    """The headline figures, each a ratio against its same-run baseline."""
    lines = []
    latency = results.get("latency")
    if latency:
        for rate, events in latency["events"].items():
            poll = latency["poll_100ms"][rate]
            lines.append(
                f"- Detection at {rate} MB/s: median {_f(events['latency_ms']['median'])} ms "
                f"(p95 {_f(events['latency_ms']['p95'])}) on kernel events vs "
                f"{_f(poll['latency_ms']['median'])} ms (p95 {_f(poll['latency_ms']['p95'])}) "
                f"polling every 100 ms: "
                f"{poll['latency_ms']['median'] / max(events['latency_ms']['median'], 1e-3):.1f}x "
                "faster.")
    busy = results.get("contended")
    if busy:
        base, ours = busy["nice_0"]["latency_ms"], busy["default"]["latency_ms"]
        lines.append(
            f"- Detection at {busy['default']['rate_mb_per_s']:g} MB/s on busy CPUs "
            f"({busy['burners']} spinning loops and a writer): p95 {_f(ours['p95'])} ms "
            f"(median {_f(ours['median'])}) at the default niceness vs {_f(base['p95'])} ms "
            f"(median {_f(base['median'])}) at nice 0: "
            f"{base['p95'] / max(ours['p95'], 1e-3):.2f}x.")
    save = results.get("saverate")
    if save:
        for rate, row in save["oomguard_default"].items():
            base = save["no_guard"][rate]
            okd = save.get("oomguard_oom_kill_disable", {}).get(rate)
            extra = (f"; with oom_kill_disable {okd['checkpointed']}/{okd['hogs']}"
                     if okd else "")
            lines.append(f"- Save rate at {rate} MB/s: {row['checkpointed']}/{row['hogs']} "
                         f"checkpointed, {row['killed']} killed by the kernel (no guard: "
                         f"{base['killed']}/{base['hogs']} killed){extra}.")
    tp = results.get("throughput")
    if tp:
        from bench.throughput import size_summary

        for mib, rows in sorted(_by_size(tp).items()):
            m = size_summary(rows)
            lines.append(
                f"- {mib} MiB: dump {m['dump_mb_per_s']:.0f} MB/s = {m['dump_ratio']:.2f} x the "
                f"disk's write+fdatasync ({m['disk_write_mb_per_s']:.0f} MB/s, median); commit "
                f"{m['commit_s'] * 1000:.0f} ms = {m['commit_to_dump']:.3f} x the dump "
                f"(reading back + SHA-256, as before: {m['old_commit_s']:.2f} s); restore with "
                f"verification {m['restore_mb_per_s']:.0f} MB/s = {m['restore_ratio']:.2f} x the "
                f"cold read ({m['disk_read_mb_per_s']:.0f} MB/s, median)" + (
                    f" = {m['restore_to_new_memory']:.2f} x the cold read into new memory "
                    f"({m['new_memory_read_mb_per_s']:.0f} MB/s, median: the floor of a "
                    f"restore on this machine); CRIU's own read of the pages into the "
                    f"process {m['restore_criu_read_s']:.2f} s of the restore's "
                    f"{m['restore_s']:.2f} s" if "restore_to_new_memory" in m
                    and "restore_criu_read_s" in m else "") + ".")
    lazy = results.get("lazy")
    if lazy:
        from bench.lazy import summary

        by = {(r["mib"], r["mode"]): r for r in summary(lazy)}
        for mib in sorted({m for m, _ in by}):
            lz, eg = by.get((mib, "lazy")), by.get((mib, "eager"))
            ld = by.get((mib, "lazy (daemon)"), lz)
            if lz and eg and ld:
                lines.append(
                    f"- Lazy restore, {mib} MiB: running {lz['command_to_running_s']:.2f} s after "
                    f"the command ({ld['command_to_running_s']:.2f} s through the daemon; the "
                    f"restore itself {ld['restore_s']:.2f} s) vs "
                    f"{eg['command_to_running_s']:.2f} s eagerly; every page in after "
                    f"{lz['resident_s']:.2f} s; first pass over its memory "
                    f"{lz['slowdown']:.1f}x slower than before the dump (eager: "
                    f"{eg['slowdown']:.1f}x).")
    packed = results.get("compress")
    if packed:
        from bench.compress import summary as packed_summary

        kinds = {(r["kind"], r["mib"], r["mode"]): r for r in packed_summary(packed)}
        for (kind, mib, mode), row in kinds.items():
            plain = kinds.get((kind, mib, "off"))
            if mode == "zstd" and plain:
                lines.append(
                    f"- zstd, {kind}, {mib} MiB: {row['stored_mb']:.0f} MB on disk for "
                    f"{row['raw_mb']:.0f} MB ({row['ratio']:.1f}x); dump {row['dump_s']:.2f} s "
                    f"vs {plain['dump_s']:.2f} s plain, commit {row['commit_s'] * 1000:.0f} ms "
                    f"vs {plain['commit_s'] * 1000:.0f} ms, restore {row['restore_s']:.2f} s vs "
                    f"{plain['restore_s']:.2f} s.")
    idle = results.get("idle")
    if idle:
        peer = next((v for k, v in idle.items() if k.startswith("earlyoom")), None)
        for label, row in idle.items():
            if label.startswith("earlyoom"):
                continue
            versus = (f" = {row['cpu_s'] / peer['cpu_s']:.1f} x earlyoom's {peer['cpu_s']:.3f} s"
                      f" and {row['rss_mib'] / peer['rss_mib']:.0f} x its RSS "
                      f"({peer['rss_mib']:.1f} MiB)" if peer and peer["cpu_s"] > 0 else "")
            lines.append(f"- Idle, {label}: {row['cpu_s']:.4f} CPU s per {row['seconds']:.0f} s, "
                         f"{row['rss_mib']:.1f} MiB RSS{versus}.")
    scale = results.get("scale")
    if scale and latency:
        for rate, row in _scale_rates(scale).items():
            one = latency["events"].get(rate)
            if one is None:
                continue
            lines.append(
                f"- Scale: with {scale.get('cgroups', 1000)} guarded cgroups detection at {rate} "
                f"MB/s takes {row['latency_ms']['median']:.1f} ms median (p95 "
                f"{row['latency_ms']['p95']:.1f}) vs {one['latency_ms']['median']:.1f} ms (p95 "
                f"{one['latency_ms']['p95']:.1f}) with one "
                f"({row['latency_ms']['median'] / max(one['latency_ms']['median'], 1e-3):.2f} x).")
    victims = results.get("victims")
    if victims:
        walk = victims["full_walk_ms"]["median"]
        for rule in ("cgroup_rule", "system_rule"):
            chose = victims[rule]["choose_ms"]["median"]
            lines.append(f"- Victim choice, {rule.replace('_', ' ')}, "
                         f"{victims['processes_on_machine']} processes on the machine: median "
                         f"{chose:.2f} ms (p95 {victims[rule]['choose_ms']['p95']:.2f}) vs "
                         f"{walk:.1f} ms for a walk of every process ({walk / max(chose, 1e-3):.0f}x"
                         " faster).")
    return lines


def _scale_rates(scale: dict[str, Any]) -> dict[str, Any]:
    """The per-rate results of the scale part (older runs held one rate, unkeyed)."""
    if "latency_ms" in scale:
        return {"500": scale}
    return {k: v for k, v in scale.items() if isinstance(v, dict) and "latency_ms" in v}


def _plots(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig: Any, ax: Any, title: str, name: str) -> str:
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        return name

    latency = results.get("latency")
    if latency:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("events", "oomguard (kernel events)"),
                           ("poll_100ms", "baseline: polling every 100 ms")):
            rates = [float(r) for r in latency[key]]
            med = [v["latency_ms"]["median"] for v in latency[key].values()]
            p95 = [v["latency_ms"]["p95"] for v in latency[key].values()]
            line = ax.plot(rates, med, marker="o", label=f"{label}, median")[0]
            ax.plot(rates, p95, marker="x", linestyle="--", color=line.get_color(),
                    label=f"{label}, p95")
        ax.set_xscale("log")
        ax.set_xlabel("allocation rate (MB/s)")
        ax.set_ylabel("threshold crossed → victim stopped (ms)")
        made.append(save(fig, ax, "Detection latency", "latency.png"))
    tp = results.get("throughput")
    if tp:
        sizes = sorted(_by_size(tp))
        grouped = _by_size(tp)
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("dump_mb_per_s", "dump (oomguard + CRIU)"),
                           ("disk_write_fdatasync_mb_per_s", "disk: write + fdatasync"),
                           ("restore_mb_per_s", "restore (verify + CRIU)"),
                           ("disk_cold_read_mb_per_s", "disk: cold read")):
            ax.plot(sizes, [_median(grouped[s], key) for s in sizes], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s} MiB" for s in sizes])
        ax.set_ylabel("MB/s (median)")
        made.append(save(fig, ax, "Checkpoint and restore throughput vs the disk",
                         "throughput.png"))
        fig, ax = plt.subplots(figsize=(7, 4))
        phases = list(tp[0]["phases_s"])
        bottom = [0.0] * len(sizes)
        for phase in phases:
            values = [statistics.median(r["phases_s"][phase] for r in grouped[s]) for s in sizes]
            ax.bar([f"{s} MiB" for s in sizes], values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("seconds (median)")
        ax.set_title("Where a checkpoint's time goes")
        ax.legend(fontsize=6, loc="upper left")
        fig.tight_layout()
        fig.savefig(out / "breakdown.png", dpi=110)
        plt.close(fig)
        made.append("breakdown.png")
    lazy = results.get("lazy")
    if lazy:
        from bench.lazy import summary

        rows = summary(lazy)
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, key, label in (("lazy", "command_to_running_s", "lazy: running again"),
                                 ("lazy (daemon)", "command_to_running_s",
                                  "lazy via the daemon: running again"),
                                 ("lazy", "resident_s", "lazy: every page in"),
                                 ("eager", "command_to_running_s", "eager: running again")):
            group = [r for r in rows if r["mode"] == mode and r.get(key) is not None]
            ax.plot([r["mib"] for r in group], [r[key] for r in group], marker="o",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("image (MiB)")
        ax.set_ylabel("seconds after the command (median)")
        made.append(save(fig, ax, "Lazy vs eager restore", "lazy.png"))
    return made


def _undumpable(found: dict[str, Any] | None) -> list[str]:
    if not found:
        return []
    lines = ["## 7. Victims CRIU cannot dump", "",
             f"Jobs holding a Unix connection to a server outside their tree (CRIU refuses "
             f"it) grow to {found['target_mib']} MiB in a {found['limit_mib']} MiB cgroup, one "
             "at a time, under each guard. `saved`: the job ran to its end with every chunk of "
             "its memory intact (paged out, then continued once the limit was raised).", ""]
    rows = []
    for key, label in (("kernel", "kernel OOM killer alone"),
                       ("earlyoom", "earlyoom -m 10"),
                       ("oomguard_checkpoint_kill", 'oomguard ["checkpoint", "kill"]'),
                       ("oomguard_checkpoint_pageout", 'oomguard ["checkpoint", "pageout"]')):
        if key in found:
            outcomes = found[key]["outcomes"]
            rows.append([label, str(found[key]["jobs"]), str(outcomes.get("saved", 0)),
                         ", ".join(f"{v} {k}" for k, v in outcomes.items() if k != "saved")
                         or "-"])
    lines += _table(["guard", "jobs", "saved", "lost"], rows)
    page = found.get("oomguard_checkpoint_pageout", {}).get("pageout")
    base = found.get("checkpoint_baseline")
    if page and base:
        lines += ["RAM given back per second: the page-out (from the checkpoint's refusal to "
                  "`victim.paged_out`, the swap file made included) against a checkpoint of "
                  "a dumpable job of the same size (frozen to committed), the baseline, in the "
                  "same run.", ""]
        lines += _table(["how", "median MiB/s", "min", "max", "median s", "runs"],
                        [[label, _f(v["mib_per_s"]["median"]), _f(v["mib_per_s"]["min"]),
                          _f(v["mib_per_s"]["max"]), _f(v["seconds"]["median"], 2),
                          str(v["mib_per_s"]["n"])]
                         for label, v in (("checkpoint (baseline)", base), ("page-out", page))])
        lines += [f"Page-out / checkpoint: {found.get('pageout_vs_checkpoint')}x", ""]
        running = page.get("to_running_s")
        if running:
            lines += [f"From resume to running (`pageout.resumed` to the job's next step "
                      f"written, its memory paged back in as it touches it): median "
                      f"{_f(running['median'], 3)} s, min {_f(running['min'], 3)}, max "
                      f"{_f(running['max'], 3)} ({running['n']} jobs).", ""]
    return lines


def write_report(results: dict[str, Any], out: Path) -> None:
    lines = ["# oomguard benchmarks", "",
             "Written by `scripts/bench` (`python -m bench`); the raw figures are in "
             "results.json. Every ratio is against a baseline measured in the same run.", "",
             "## Machine", ""]
    lines += _table(["what", "value"], [[k, str(v)] for k, v in results["machine"].items()])
    if results.get("partial"):  # the machine above is the last partial run's
        lines += ["The machine and commit above are the latest run's. Parts re-run alone on "
                  "top of the last full run (the other sections are that run's): "
                  + "; ".join(f"{', '.join(p['parts'])} ({p['date']})"
                              for p in results["partial"]) + ".", ""]
    lines += ["## Headline ratios", "", *ratios(results), ""]
    plots = _plots(results, out)
    latency = results.get("latency")
    if latency:
        lines += ["## 1. Detection latency", "",
                  "Threshold crossing (128 MiB of a 256 MiB limit; from the start of the hog's "
                  "2 MiB allocation step that crossed it, an upper bound) to victim stopped "
                  "(the daemon's `victim.frozen` event).", ""]
        rows = []
        for key, label in (("events", "oomguard"), ("poll_100ms", "polling 100 ms")):
            for rate, v in latency[key].items():
                rows.append([label, rate, _f(v["achieved_mb_per_s"], 0),
                             _f(v["latency_ms"]["median"]), _f(v["latency_ms"]["p95"]),
                             _f(v["latency_ms"]["max"]), _f(v["detect_to_frozen_ms"]["median"], 2),
                             str(v["latency_ms"]["n"])])
        lines += _table(["guard", "rate MB/s", "achieved MB/s", "median ms", "p95 ms", "max ms",
                         "detect→stopped ms", "runs"], rows)
        lines += ["![latency](latency.png)", ""] if "latency.png" in plots else []
    busy = results.get("contended")
    if busy:
        lines += ["### Detection on busy CPUs", "",
                  f"The same measurement at {busy['default']['rate_mb_per_s']:g} MB/s while "
                  f"{busy['burners']} shell loops spin and dd writes 256 MiB with fsync over "
                  "and over: the guard at the ordinary priority (`daemon.nice = 0`, the "
                  "baseline) and at the default (`nice = -10` for the event loop and the "
                  "worker until the victim is stopped), under the same load, one after the "
                  "other.", ""]
        lines += _table(["guard", "median ms", "p95 ms", "max ms", "detect→stopped ms", "runs"],
                        [[label, _f(v["latency_ms"]["median"]), _f(v["latency_ms"]["p95"]),
                          _f(v["latency_ms"]["max"]), _f(v["detect_to_frozen_ms"]["median"], 2),
                          str(v["latency_ms"]["n"])]
                         for label, v in (("nice 0 (baseline)", busy["nice_0"]),
                                          ("default (nice -10)", busy["default"]))])
    save = results.get("saverate")
    if save:
        lines += ["## 2. Save rate", "",
                  "Hogs growing to 400 MiB in a 256 MiB cgroup (threshold 85%), one at a time.",
                  ""]
        rows = []
        for guard, per_rate in save.items():
            for rate, v in per_rate.items():
                rows.append([guard, rate, str(v["hogs"]), str(v["checkpointed"]),
                             str(v["killed"]), str(v["other"])])
        lines += _table(["guard", "rate MB/s", "hogs", "checkpointed", "killed by kernel",
                         "other"], rows)
    tp = results.get("throughput")
    if tp:
        lines += ["## 3. Checkpoint and restore throughput", ""]
        from bench.throughput import size_summary

        lines += ["Per size, the medians of the runs against the medians of every disk "
                  "baseline sample taken before them (a file the size of the image, written "
                  "+ fdatasync'd, then read back cold); restore is timed from its first check "
                  "to the tree running, verification included.", ""]
        summary_rows = []
        for mib, group in sorted(_by_size(tp).items()):
            m = size_summary(group)
            summary_rows.append([str(mib), _f(m["dump_mb_per_s"], 0),
                                 _f(m["disk_write_mb_per_s"], 0), _f(m["dump_ratio"], 2),
                                 _f(m["commit_s"] * 1000, 0), _f(m["commit_to_dump"], 3),
                                 _f(m["old_commit_s"], 2), _f(m["restore_mb_per_s"], 0),
                                 _f(m["disk_read_mb_per_s"], 0), _f(m["restore_ratio"], 2),
                                 _f(m.get("new_memory_read_mb_per_s"), 0),
                                 _f(m.get("restore_to_new_memory"), 2),
                                 _f(m.get("restore_criu_read_s"), 2)])
        lines += _table(["MiB", "dump MB/s", "disk write MB/s", "dump/disk", "commit ms",
                         "commit/dump", "old commit s", "restore MB/s", "disk read MB/s",
                         "restore/disk", "read into new memory MB/s", "restore/new memory",
                         "CRIU's page read s"], summary_rows)
        lines += ["*Read into new memory*: the same cold read into an anonymous mapping "
                  "made for it and never touched, as CRIU's restorer reads the pages into the "
                  "restored process (each page faulted in and zeroed first; on this VM the "
                  "host also provides each new page on first touch); *CRIU's page read*: "
                  "its restorer's preadv of the pages, from restore.log.", ""]
        lines += ["Every run:", ""]
        rows = []
        for row in tp:
            rows.append([str(row["mib"]), str(row["processes"]),
                         _f(row["image_bytes"] / 1e6, 0), _f(row["allocation_mb_per_s"], 0),
                         _f(row["dump_s"], 2), _f(row["dump_mb_per_s"], 0),
                         _f(row["disk_write_fdatasync_mb_per_s"], 0),
                         _f(row["dump_mb_per_s"] / row["disk_write_fdatasync_mb_per_s"], 2),
                         _f(row.get("commit_s"), 3),
                         _f(row["restore_s"], 2), _f(row.get("restore_verify_s"), 2),
                         _f(row["restore_mb_per_s"], 0), _f(row["disk_cold_read_mb_per_s"], 0),
                         _f(row["restore_mb_per_s"] / row["disk_cold_read_mb_per_s"], 2),
                         "yes" if row["resumed"] else "NO"])
        lines += _table(["MiB", "procs", "image MB", "alloc MB/s", "dump s", "dump MB/s",
                         "disk write MB/s", "dump/disk", "commit s", "restore s", "verify s",
                         "restore MB/s", "disk read MB/s", "restore/disk", "resumed"], rows)
        lines += ["Where the time goes (median seconds per phase):", ""]
        grouped = _by_size(tp)
        phases = list(tp[0]["phases_s"])
        lines += _table(["phase", *[f"{s} MiB" for s in sorted(grouped)]],
                        [[p, *[_f(statistics.median(r["phases_s"][p] for r in grouped[s]), 3)
                               for s in sorted(grouped)]] for p in phases])
        lines += [f"![{p}]({p})" for p in ("throughput.png", "breakdown.png") if p in plots]
        lines += [""]
    lazy = results.get("lazy")
    if lazy:
        from bench.lazy import summary

        lines += ["## 3b. Lazy restore", "",
                  "The same checkpoint restored lazily (`restore --lazy`) by the CLI on the "
                  "store, lazily through the daemon, then eagerly (`--force`), the job killed "
                  "in between and the cache dropped before each. "
                  "*Running*: the command to every process's first beat (a thread beating every "
                  "2 ms); *restore*: the restore's own time (first check to the tree running, "
                  "without the CLI's start); *resident*: every page in (lazy.json); *slowdown*: "
                  "the first pass over all its memory after the restore against a pass before "
                  "the dump. Medians.", ""]
        lines += _table(["MiB", "mode", "runs", "running s", "restore s", "resident s",
                         "first pass s", "pass before s", "slowdown", "intact"],
                        [[str(r["mib"]), r["mode"], str(r["runs"]),
                          _f(r.get("command_to_running_s"), 3), _f(r.get("restore_s"), 3),
                          _f(r.get("resident_s"), 2), _f(r.get("first_pass_s"), 2),
                          _f(r.get("pass_before_s"), 2), _f(r.get("slowdown"), 1),
                          "yes" if r["intact"] else "NO"] for r in summary(lazy)])
        lines += ["![lazy.png](lazy.png)", ""] if "lazy.png" in plots else []
    packed = results.get("compress")
    if packed:
        from bench.compress import summary as packed_summary

        lines += ["## 3c. Compressed pages", "",
                  "The same workload checkpointed with `[criu] compress = \"off\"` and "
                  "`\"zstd\"` (level 3), then restored; MB/s are of the memory (plain bytes). "
                  "Medians.", ""]
        lines += _table(["kind", "MiB", "compress", "runs", "memory MB", "on disk MB", "ratio",
                         "dump s", "dump MB/s", "commit ms", "restore s", "restore MB/s",
                         "intact"],
                        [[r["kind"], str(r["mib"]), r["mode"], str(r["runs"]),
                          _f(r["raw_mb"], 0), _f(r["stored_mb"], 1), _f(r["ratio"], 1),
                          _f(r["dump_s"], 2), _f(r["dump_mb_per_s"], 0),
                          _f(r["commit_s"] * 1000, 0), _f(r["restore_s"], 2),
                          _f(r["restore_mb_per_s"], 0), "yes" if r["intact"] else "NO"]
                         for r in packed_summary(packed)])
    idle = results.get("idle")
    if idle:
        lines += ["## 4. Idle cost", "", "The same windows for all, side by side: CPU seconds "
                  "per window, the median of consecutive windows (each window's in results.json: "
                  "on this VM the host's steal lands in some, for every process alike).", ""]
        lines += _table(["process", "seconds", "CPU s", "CPU s (ticks)", "RSS MiB",
                         "peak RSS MiB", "threads", "start-up s", "start-up CPU s"],
                        [[k, _f(v["seconds"]), _f(v["cpu_s"], 4), _f(v["cpu_s_ticks"], 2),
                          _f(v["rss_mib"]), _f(v["peak_rss_mib"]), str(v["threads"]),
                          _f(v.get("startup_s"), 2), _f(v.get("startup_cpu_s"), 2)]
                         for k, v in idle.items()])
    scale = results.get("scale")
    if scale:
        lines += ["## 5. Scale", "", f"Detection latency in one of {scale.get('cgroups', 1000)} "
                  "guarded cgroups, the others idle.", ""]
        lines += _table(["rate MB/s", "median ms", "p95 ms", "max ms", "runs"],
                        [[rate, _f(v["latency_ms"]["median"]), _f(v["latency_ms"]["p95"]),
                          _f(v["latency_ms"]["max"]), str(v["latency_ms"]["n"])]
                         for rate, v in _scale_rates(scale).items()])
    victims = results.get("victims")
    if victims:
        lines += ["## 6. Victim choice on a crowded machine", "",
                  f"{victims['crowd']:,} sleeping processes beside the job "
                  f"({victims['processes_on_machine']:,} on the machine). `choose_ms`: the "
                  "daemon reading and ranking the candidate trees at the crossing. Baseline: a "
                  "walk of every process (how system rules chose before), in the same run.", ""]
        rows = [["baseline: walk of all of /proc", _f(victims["full_walk_ms"]["median"], 2),
                 _f(victims["full_walk_ms"]["p95"], 2), str(victims["full_walk_ms"]["n"])]]
        for rule, label in (("cgroup_rule", "cgroup rule (cgroup.procs)"),
                            ("system_rule", "system rule (ranking kept, dry run)")):
            row = victims[rule]["choose_ms"]
            rows.append([label, _f(row["median"], 2), _f(row["p95"], 2), str(row["n"])])
        one = victims.get("one_parent")
        if one:
            rows.append(["one parent of them all: walk of all of /proc",
                         _f(one["full_walk_ms"]["median"], 2), _f(one["full_walk_ms"]["p95"], 2),
                         str(one["full_walk_ms"]["n"])])
            row = one["system_rule"]["choose_ms"]
            rows.append(["one parent of them all: system rule (its family is a candidate)",
                         _f(row["median"], 2), _f(row["p95"], 2), str(row["n"])])
        lines += _table(["how", "median ms", "p95 ms", "runs"], rows)
    lines += _undumpable(results.get("undumpable"))
    lines += [f"Run time per part (s): {results.get('seconds')}", ""]
    (out / "results.md").write_text("\n".join(lines))
