"""Compressed pages (`[criu] compress = "zstd"`) against plain ones, in the same run: for memory
of zeros (written), text (random words: compresses about as prose does) and random bytes
(tests/workloads/filler.py), 256 MiB and 1 GiB, the bytes on disk, the dump (until the memory
is free), the commit (the swap to the .zst), the restore (expansion and verification
included), and whether the memory came back intact."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import REPO, CgroupFactory, kill_pid, wait_until

FILLER = REPO / "tests" / "workloads" / "filler.py"
MB = 1_000_000


def _cli(store: Path, config: Path, *args: str) -> dict[str, Any]:
    from bench.harness import cli_result

    env_before = os.environ.get("OOMGUARD_CONFIG")
    os.environ["OOMGUARD_CONFIG"] = str(config)
    try:
        return cli_result(store, *args)[0]
    finally:
        if env_before is None:
            os.environ.pop("OOMGUARD_CONFIG", None)
        else:
            os.environ["OOMGUARD_CONFIG"] = env_before


def one(factory: CgroupFactory, work: Path, kind: str, mib: int, mode: str,
        index: int) -> dict[str, Any]:
    name = f"cz-{kind}-{mib}-{mode}-{index}"
    cgroup = factory.make(name, None)
    store = work / f"store-{name}"
    config = work / f"{name}.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\n\n[criu]\ncompress = "{mode}"\n')
    log = work / f"{name}.log"
    log.unlink(missing_ok=True)
    argv = [sys.executable, str(FILLER), "--kind", kind, "--mib", str(mib), "--log", str(log)]
    proc = subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                             str(cgroup.path / "cgroup.procs"), *argv],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        if not wait_until(lambda: log.exists() and "pass 1 " in log.read_text(), 180):
            raise RuntimeError(f"{name}: the filler did not get ready")
        done = _cli(store, config, "checkpoint", str(proc.pid), "--reason", "benchmark")
        proc.wait(timeout=30)
        meta = json.loads((store / done["id"] / "meta.json").read_text())
        raw = sum(p.stat().st_size for p in (store / done["id"] / "images").glob("pages-*.img"))
        raw += sum(meta.get("extra", {}).get("compressed", {}).values())
        wait_until(lambda: not Path(f"/proc/{proc.pid}").exists(), 30)
        passes = log.read_text().count("pass ")
        restored = _cli(store, config, "restore", done["id"])
        intact = wait_until(lambda: log.read_text().count("pass ") > passes, 60)
        text = log.read_text()
        return {"kind": kind, "mib": mib, "mode": mode, "raw_bytes": raw,
                "stored_bytes": done["image_bytes"], "dump_s": done["dump_s"],
                "commit_s": done["commit_s"], "restore_s": restored.get("total_s"),
                "intact": bool(intact) and "CORRUPT" not in text}
    finally:
        for pid in cgroup.procs():
            kill_pid(pid)
        kill_pid(proc.pid)
        shutil.rmtree(store, ignore_errors=True)


def compression(factory: CgroupFactory, work: Path, sizes: list[int],
                repeats: int) -> list[dict[str, Any]]:
    return [one(factory, work, kind, mib, mode, index)
            for index in range(repeats) for mib in sizes
            for kind in ("zeros", "text", "random") for mode in ("off", "zstd")]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in sorted({(r["kind"], r["mib"], r["mode"]) for r in rows},
                      key=lambda k: (k[1], ("zeros", "text", "random").index(k[0]), k[2])):
        group = [r for r in rows if (r["kind"], r["mib"], r["mode"]) == key]

        def med(field: str, group: list[dict[str, Any]] = group) -> float:
            return float(statistics.median(float(r[field]) for r in group))
        out.append({"kind": key[0], "mib": key[1], "mode": key[2], "runs": len(group),
                    "raw_mb": med("raw_bytes") / MB, "stored_mb": med("stored_bytes") / MB,
                    "ratio": med("raw_bytes") / max(med("stored_bytes"), 1.0),
                    "dump_s": med("dump_s"), "commit_s": med("commit_s"),
                    "restore_s": med("restore_s"),
                    "dump_mb_per_s": med("raw_bytes") / MB / med("dump_s"),
                    "restore_mb_per_s": med("raw_bytes") / MB / med("restore_s"),
                    "intact": all(r["intact"] for r in group)})
    return out
