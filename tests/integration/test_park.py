"""Memory taken inside one system call, which no SIGSTOP can interrupt: on default settings the
job is parked at its limit (v1 oom_kill_disable) or throttled (v2 memory.high), then
checkpointed, never OOM-killed. Runs on the host (v1) and in the v2 VM lane."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.store.checkpoints import Store
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    proc_state,
    read_counts,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
POPULATE = REPO / "tests" / "workloads" / "populate.py"


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_map_populate_in_one_call_is_checkpointed_not_killed(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    small = cgroups.make("populate", 256 * MiB)
    log = tmp_path / "populate.log"
    config = tmp_path / "defaults.toml"  # a guard on default settings, nothing else
    config.write_text(f'[[guard]]\ncgroups = ["{small.path}"]\n')
    # Beside it, as a slice's other service: held while the job is dumped, and never the
    # OOM killer's while the job, stopped inside its mmap, runs on to the limit (v2: the
    # guard lifts its memory.high for the stop; both are shielded until it has stopped).
    bystander = start_in_cgroup(small, ["sleep", "600"])
    adj = Path(f"/proc/{bystander.pid}/oom_score_adj")
    own_adj = adj.read_text()
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        job = start_in_cgroup(small, [sys.executable, str(POPULATE), str(log), "400"])
        settled = wait_until(lambda: guard.events("checkpoint.done") or guard.events(
            "oom.kill_seen"), timeout=600)  # minutes under the v2 lane's emulation
        assert settled and settled[0]["event"] == "checkpoint.done", guard.log.read_text()[-4000:]
        done = settled[0]
        assert job.wait(timeout=30) == -signal.SIGKILL  # CRIU's kill after the dump
        assert done["pid"] == job.pid
        assert wait_until(lambda: proc_state(bystander.pid) == "S", 30), (
            proc_state(bystander.pid), guard.log.read_text()[-4000:])
    assert bystander.poll() is None, "the bystander was killed"
    assert adj.read_text() == own_adj, "the bystander's shield was not put back"
    kill_pid(bystander.pid)
    bystander.wait(timeout=10)
    snap = small.snapshot()
    assert snap.oom_kills == 0, "the kernel OOM killer fired"
    assert snap.usage_bytes < 16 * MiB
    assert not any(line.startswith("done") for line in _lines(log))
    assert Store(store).get(done["id"]).image_bytes > 128 * MiB

    big = cgroups.make("populatebig", 768 * MiB)
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        finished = wait_until(lambda: [x for x in _lines(log) if x.startswith(("done", "corrupt"))],
                              timeout=600)
        assert finished == [f"done {400 * MiB // 4096} pages"], (_lines(log), proc_state(pid))
        assert _lines(log)[0] == f"start {job.pid} 400"
        assert big.snapshot().oom_kills == 0
    finally:
        kill_pid(pid)


def test_task_parked_before_the_daemon_starts_is_checkpointed_and_restores(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A hog already waiting at the limit (oom_kill_disable left on: a daemon died while it
    grew) is checkpointed at the next start, and the restored hog goes on where it was."""
    small = cgroups.make("parked", 256 * MiB)
    if not isinstance(small, V1MemoryCgroup):
        pytest.skip("cgroup v1 only: v2 has no oom_kill_disable")
    small.set_oom_kill_disable(True)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(small, hog_argv(log, target=400, rate=1000, count=250))
    assert wait_until(lambda: small.snapshot().under_oom, 60), "the hog never reached its limit"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(small.path)) as guard:
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert hog.wait(timeout=30) == -signal.SIGKILL
    assert small.snapshot().oom_kills == 0
    before = last_count(log)
    big = cgroups.make("parkedbig", 768 * MiB)
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.strip())
    try:
        assert wait_until(lambda: any(x.startswith("done") for x in _lines(log)), 60), (
            _lines(log)[-3:], proc_state(pid))
        assert read_counts(log) == list(range(1, 251)) and before > 0
    finally:
        kill_pid(pid)


def _v1_only(cgroup: object) -> None:
    if not isinstance(cgroup, V1MemoryCgroup):
        pytest.skip("cgroup v1 only: v2 has no oom_kill_disable")


def _guard_config(path: Path, cgroup: Path, extra: str = "") -> Path:
    path.write_text(f'[[guard]]\ncgroups = ["{cgroup}"]\n{extra}')
    return path


def test_oom_kill_disable_after_a_daemon_is_sigkilled(cgroups: CgroupFactory, store: Path,
                                                      tmp_path: Path) -> None:
    """The park outlives a SIGKILLed daemon; the next start keeps it (with the user's original
    remembered) where it still guards that way, and puts the original back where not."""
    guarded, other = cgroups.make("crash", 256 * MiB), cgroups.make("crashother", 256 * MiB)
    _v1_only(guarded)
    same = _guard_config(tmp_path / "same.toml", guarded.path)
    elsewhere = _guard_config(tmp_path / "elsewhere.toml", other.path)
    unparked = _guard_config(tmp_path / "unparked.toml", guarded.path, "oom_kill_disable = false\n")

    def start_and_sigkill(config: Path, log: str) -> None:
        with daemon(store, tmp_path / log, "--config", str(config)) as dead:
            dead.wait_event("guard.armed")
            assert guarded.oom_kill_disabled()
            dead.handle.kill()
            dead.handle.wait()
        assert guarded.oom_kill_disabled(), "a SIGKILLed daemon cannot put anything back"

    start_and_sigkill(same, "d1.log")
    with daemon(store, tmp_path / "d2.log", "--config", str(same)) as again:
        again.wait_event("guard.armed")
        assert guarded.oom_kill_disabled() and not again.events("guard.setting_restored")
    assert not guarded.oom_kill_disabled(), "the original (0) was not put back at the stop"

    start_and_sigkill(same, "d3.log")
    with daemon(store, tmp_path / "d4.log", "--config", str(elsewhere)) as moved:
        moved.wait_event("guard.armed")
        # Put back after the guards are armed: the write, then its log line (wait for that).
        restored, = moved.wait_event("guard.setting_restored")
        assert not guarded.oom_kill_disabled()
        assert restored["cgroup"] == str(guarded.path)
        assert restored["setting"] == "oom_kill_disable 0"
        assert other.oom_kill_disabled()
    assert not other.oom_kill_disabled()

    start_and_sigkill(same, "d5.log")
    with daemon(store, tmp_path / "d6.log", "--config", str(unparked)) as off:
        off.wait_event("guard.armed")
        assert off.wait_event("guard.setting_restored")
        assert not guarded.oom_kill_disabled()
    assert not guarded.oom_kill_disabled()


def test_the_watchdog_releases_a_park_no_action_can_end(cgroups: CgroupFactory, store: Path,
                                                        tmp_path: Path) -> None:
    """The only victim is protected and no action kills: the hog waits at the limit until
    park_deadline, then the kernel's OOM killer acts, and the event says why."""
    small = cgroups.make("release", 256 * MiB)
    _v1_only(small)
    config = _guard_config(tmp_path / "protect.toml", small.path,
                           'actions = ["checkpoint"]\nprotect = ["hog\\\\.py"]\n'
                           'park_deadline = "3s"\n')
    log = tmp_path / "hog.log"
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(small, hog_argv(log, target=400, rate=1000, count=250))
        assert wait_until(lambda: small.snapshot().under_oom, 60), "the hog never parked"
        released = guard.wait_event("oom.released", timeout=60)[0]
        assert hog.wait(timeout=60) == -signal.SIGKILL
        assert released["cgroup"] == str(small.path) and released["park_deadline"] == 3.0
        assert released["parked_seconds"] >= 3.0
        assert "no victim could be checkpointed" in released["reason"]
        assert guard.events("victim.none") and not guard.events("checkpoint.done")
        guard.wait_event("oom.rearmed", timeout=30)
        assert small.oom_kill_disabled(), "the park is not armed again"
    assert small.snapshot().oom_kills >= 1  # the kernel acted, as it would without oomguard
    assert not small.oom_kill_disabled()
    assert not Store(store).list()
