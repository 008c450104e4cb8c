"""The soak drill's verdict on a lost job (bench/soakcheck.py): how it ended, and the daemon's
events around its end, kept for the table when the run's logs are gone."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from bench.soakcheck import ending, evidence, oom_evidence

CG = "/sys/fs/cgroup/soak/c03"
END = 1_800_000_000.0


def at(seconds: float, name: str, **fields: Any) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(END + seconds, tz=UTC).isoformat()
    return {"timestamp": stamp.replace("+00:00", "Z"), "event": name, **fields}


EVENTS = [
    at(-60, "checkpoint.done", cgroup=CG, pid=10),  # too early
    at(-3, "checkpoint.failed", cgroup=CG, pid=633, error="criu dump timed out"),
    at(-2.5, "limit.restore_failed", cgroup=CG, usage=140 << 20, limit=128 << 20),
    at(-2, "victim.killed", cgroup="/sys/fs/cgroup/soak/c04", pid=700),  # another cgroup's
    at(-1, "victim.killed", cgroup=CG, pid=633, reason="the lifted limit must come back"),
    at(0.2, "oom.kill_seen", cgroup=CG),
    at(30, "guard.armed", cgroup=CG),  # too late
]


def test_a_lost_jobs_evidence_is_its_cgroups_and_its_pids_events_around_its_end() -> None:
    trail = evidence(EVENTS, CG, 633, END)
    assert [line.split(" ")[1] for line in trail] == [
        "checkpoint.failed:", "limit.restore_failed:", "victim.killed:", "oom.kill_seen:"]
    assert trail[0] == "-3.00s checkpoint.failed: pid=633, error=criu dump timed out"
    assert "usage=146800640, limit=134217728" in trail[1]
    assert trail[3].startswith("+0.20s oom.kill_seen")


def test_an_oom_kill_with_no_job_lost_keeps_the_cgroups_events_around_it() -> None:
    trail = oom_evidence(EVENTS, CG)  # centred on oom.kill_seen, 0.2 s after END
    assert [line.split(" ")[1] for line in trail] == [
        "checkpoint.failed:", "limit.restore_failed:", "victim.killed:", "oom.kill_seen:"]
    assert trail[-1].startswith("+0.00s oom.kill_seen")
    assert oom_evidence(EVENTS, "/sys/fs/cgroup/soak/c99") == []


def test_a_sigkill_with_an_oom_kill_in_its_cgroup_reads_as_oom_killed() -> None:
    assert ending(-9, "", END, CG, 633, [], [], EVENTS).cause == "oom-killed"
    assert ending(-9, "", END, CG, 633, [], [], EVENTS[:2]).cause == "killed"
    assert ending(12, "hog: error write: ENOMEM", END, CG, 633, [], [], []).cause == "enomem"
