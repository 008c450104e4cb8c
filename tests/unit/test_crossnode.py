"""bench/crossnode.py's arithmetic: a lane directory as scripts/cluster-lane leaves it (the two
daemons' JSON logs among other lines, the batch script's start, the baselines, the clocks)
turned into the phases of a cross-node resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.crossnode import collect, table

MiB = 1 << 20


def lane_dir(tmp_path: Path) -> Path:
    log = tmp_path / "log"
    log.mkdir()
    (log / "oomguard-nodea.log").write_text("\n".join([
        "not json: a line the daemon's start printed",
        json.dumps({"event": "guard.started", "timestamp": "2026-12-07T10:00:00.000000Z"}),
        json.dumps({"event": "threshold.crossed", "timestamp": "2026-12-07T10:00:10.000000Z"}),
        json.dumps({"event": "checkpoint.done", "timestamp": "2026-12-07T10:00:30.500000Z",
                    "image_bytes": 1024 * MiB, "dump_s": 16.0, "seconds": 20.0}),
        json.dumps({"event": "threshold.crossed", "timestamp": "2026-12-07T10:09:00.000000Z"}),
    ]) + "\n")
    (log / "oomguard-nodeb.log").write_text(
        json.dumps({"event": "restore.done", "timestamp": "2026-12-07T10:01:05.500000Z",
                    "seconds": 8.0}) + "\n")
    began = 1796637600.0 + 50.5  # 10:00:50.5 UTC
    (tmp_path / "t-batch-start").write_text(f"{began}\n")
    (tmp_path / "bench-write.json").write_text(json.dumps({"bytes": 1024 * MiB, "seconds": 8}))
    (tmp_path / "bench-read.json").write_text(json.dumps({"bytes": 1024 * MiB, "seconds": 4}))
    (tmp_path / "host-clocks.json").write_text(json.dumps(
        {"a": {"node": 100.0125, "host": 100.0}, "b": {"node": 50.0, "host": 50.002}}))
    (tmp_path / "result").write_text("PASS: job 1 checkpointed on nodea, resumed on nodeb\n")
    return tmp_path


def test_the_phases_of_a_cross_node_resume(tmp_path: Path) -> None:
    run = collect(lane_dir(tmp_path))
    assert run["image_mib"] == 1024
    assert run["dump_s"] == 20.5  # the first crossing to checkpoint.done
    assert run["dump_mib_s"] == 64  # 1024 MiB in CRIU's 16 s
    assert run["requeue_and_scheduling_s"] == 20.0  # 10:00:30.5 on A to 10:00:50.5 on B
    assert run["restore_s"] == 15.0
    assert run["restore_mib_s"] == 128
    assert run["total_s"] == 55.5
    assert (run["nfs_write_mib_s"], run["nfs_read_mib_s"]) == (128, 256)
    assert (run["dump_vs_nfs_write"], run["restore_vs_nfs_read"]) == (0.5, 0.5)
    assert run["clock_offsets_ms"] == {"a": 12.5, "b": -2.0}
    text = table([run, run])
    assert "| total: threshold on A to running on B (s) | 55.5 | 55.5 | 55.5 |" in text
    assert "a +12.5 ms, b -2 ms" in text


def test_a_run_without_its_checkpoint_says_which_event_is_missing(tmp_path: Path) -> None:
    shared = lane_dir(tmp_path)
    (shared / "log" / "oomguard-nodeb.log").write_text("")
    with pytest.raises(LookupError, match=r"restore\.done"):
        collect(shared)
