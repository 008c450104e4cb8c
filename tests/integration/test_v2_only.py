"""cgroup v2 specifics, on a real v2 kernel (inside the VM lane; skipped on v1 hosts):
memory.high at the threshold and put back, cgroup.freeze before the dump, crash recovery of a
frozen cgroup, the detection paths in use."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from oomguard.cgroup.mounts import read_layout
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.daemon.guardarming import HIGH_TAKEBACKS_FOLLOWED
from oomguard.respond.actor import unparked
from oomguard.sense.procfs import ProcReader
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import FROZEN_LEDGER
from tests.helpers import (
    EMULATION_FACTOR,
    CgroupFactory,
    DaemonProcess,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    last_count,
    start_in_cgroup,
    wait_until,
)

THROTTLED = "mem_cgroup_handle_over_high"  # where a task sleeps out its memory.high penalty

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(read_layout().memory_version != 2,
                       reason="needs a cgroup v2 memory controller: runs inside the VM lane "
                              "(tests/integration/test_v2_lane.py)"),
]


def test_memory_high_events_drive_detection_and_high_is_put_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("high", 128 * MiB)
    assert isinstance(cg, V2MemoryCgroup)
    assert cg.high() is None
    guard = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    try:
        armed = guard.wait_event("guard.armed", timeout=60)[0]
        assert armed["cgroup_version"] == 2
        assert "memory.high at 85%" in armed["detection"] and "memory.events" in armed["detection"]
        assert "PSI" in armed["detection"]
        assert cg.high() == int(128 * MiB * 0.85) // 4096 * 4096  # the kernel keeps whole pages
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=200, rate=100,
                                           count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=120)[0]
        assert hog.wait(timeout=30) == -signal.SIGKILL
        crossed = guard.events("threshold.crossed")[0]
        assert crossed["source"] == "event", "v2 crossing should come from memory.events"
        frozen = guard.events("cgroup.frozen")[0]
        # The guard's own memory.high throttles the hog: the freezer parks a task only once
        # its penalty is over (up to 2 s, measured up to 451 ms in this VM), and the worker
        # waits CGROUP_FREEZE_TIMEOUT for it. Not frozen in time says what it waited for
        # (nothing, where the hog was parked between the wait's end and the read).
        assert frozen["frozen"] is True or all(
            thread["wchan"] == THROTTLED or thread["state"] == "R"
            for thread in frozen["unparked"]), frozen
        told = "" if frozen["frozen"] else f" (not yet: {frozen['unparked']})"
        print(f"\nv2 detection: event -> cgroup frozen {frozen['detect_to_frozen_ms']} ms{told}, "
              f"-> victim stopped {guard.events('victim.frozen')[0]['detect_to_frozen_ms']} ms; "
              f"dump {done['dump_s']} s for {done['image_bytes'] >> 20} MiB")
    finally:
        stopped = guard.stop()
    tail = (tmp_path / "daemon.log").read_text()[-3000:]
    assert stopped == 0, f"the daemon did not stop cleanly (exit {stopped}):\n{tail}"
    assert cg.high() is None, f"memory.high not put back when the guard stopped:\n{tail}"
    assert cg.snapshot().oom_kills == 0
    assert not cg.is_frozen()


def _guarded_with_high_at_threshold(cgroups: CgroupFactory, store: Path, tmp_path: Path,
                                   name: str, limit: int,
                                   ) -> tuple[V2MemoryCgroup, int, DaemonProcess]:
    """A cgroup under a guard at 85%, ready, its memory.high set there: (cgroup, that mark,
    the daemon); the caller stops the daemon."""
    cg = cgroups.make(name, limit)
    assert isinstance(cg, V2MemoryCgroup)
    mark = int(limit * 0.85) // 4096 * 4096
    guard = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
    try:
        guard.wait_event("guard.ready", timeout=60)
        assert cg.high() == mark
    except BaseException:
        guard.stop()
        raise
    return cg, mark, guard


def test_memory_high_taken_back_by_a_scheduler_is_set_again_and_theirs_put_back(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """Slurm's task/cgroup writes memory.high (the job's limit) after the job cgroup's limit,
    and the daemon had armed in between: without a look at memory.high, the kernel throttled
    and woke oomguard only at the limit (the cluster lane's 1.25 GiB job was caught there, not
    at 80%). Now the write is seen, memory.high is set at the threshold again, the job is
    caught there, and the scheduler's value is what goes back when the guard stops."""
    limit = 128 * MiB
    cg, mark, guard = _guarded_with_high_at_threshold(cgroups, store, tmp_path, "taken", limit)
    hog = None
    try:
        (cg.path / "memory.high").write_text(str(limit))  # as slurmstepd does
        said = guard.wait_event("guard.high_taken_back", timeout=30)[0]
        assert said["memory_high"] == limit and said["cgroup"] == str(cg.path), said
        assert wait_until(lambda: cg.high() == mark, 30), cg.high()
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=200, rate=100,
                                           count=100_000))
        guard.wait_event("checkpoint.done", timeout=120)
        crossed = guard.events("threshold.crossed")[0]
        assert crossed["source"] == "event" and crossed["usage"] < limit, crossed
    finally:
        stopped = guard.stop()
        if hog is not None:
            kill_pid(hog.pid)
    tail = (tmp_path / "daemon.log").read_text()[-3000:]
    assert stopped == 0, tail
    assert cg.high() == limit, f"the scheduler's memory.high not put back:\n{tail}"


def test_memory_high_taken_back_again_and_again_is_given_up_not_fought(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A writer that puts its memory.high back whenever it changes (a controller reconciling
    its own value) would be fought for ever, each write of one waking the other. oomguard
    follows HIGH_TAKEBACKS_FOLLOWED take-backs in the window, then yields: theirs stands, the
    guard polls instead, and a hog is still checkpointed, not killed."""
    limit = 128 * MiB
    cg, mark, guard = _guarded_with_high_at_threshold(cgroups, store, tmp_path, "fought", limit)
    hog = None
    try:
        # The other writer: its value back each time it sees oomguard's, as fast as it can.
        writes = 0
        deadline = time.monotonic() + 60 * EMULATION_FACTOR
        while not guard.events("guard.high_yielded") and time.monotonic() < deadline:
            if cg.high() == mark:
                (cg.path / "memory.high").write_text(str(limit))
                writes += 1
            time.sleep(0.005)
        said = guard.wait_event("guard.high_yielded", timeout=1)[0]
        assert said["takebacks"] == HIGH_TAKEBACKS_FOLLOWED + 1 and said["memory_high"] == limit
        assert len(guard.events("guard.high_taken_back")) == HIGH_TAKEBACKS_FOLLOWED
        assert writes >= HIGH_TAKEBACKS_FOLLOWED + 1, writes  # (one may land under a re-arm)
        def armed_since_yield() -> list[dict[str, object]]:
            names = [e["event"] for e in guard.events()]
            after = guard.events()[names.index("guard.high_yielded"):]
            return [e for e in after if e["event"] == "guard.armed"]
        armed = wait_until(armed_since_yield, 30)
        assert armed and "polling" in str(armed[-1]["detection"]), armed
        assert "memory.high" not in str(armed[-1]["detection"]), armed
        assert cg.high() == limit, "memory.high set again after oomguard yielded"
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=200, rate=50,
                                           count=100_000))
        guard.wait_event("checkpoint.done", timeout=120)
        assert hog.wait(timeout=30) == -signal.SIGKILL
        assert cg.high() == limit
    finally:
        stopped = guard.stop()
        if hog is not None:
            kill_pid(hog.pid)
    tail = (tmp_path / "daemon.log").read_text()[-3000:]
    assert stopped == 0, tail
    assert cg.high() == limit, f"their memory.high not left as it was:\n{tail}"
    assert cg.snapshot().oom_kills == 0, tail


def test_a_throttled_task_is_told_unparked_until_the_freezer_has_it(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    """A task over memory.high sleeps out its penalty (D, killable only) before the freezer
    can park it: the CI run where cgroup.frozen said False had such a hog. The event's
    `unparked` names each thread the freeze still waits for, and where it sleeps."""
    cg = cgroups.make("throttled", 256 * MiB)
    assert isinstance(cg, V2MemoryCgroup)
    cg.set_high(48 * MiB)
    hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=200, rate=400,
                                       count=100_000))
    proc = ProcReader()
    try:
        assert wait_until(lambda: any(thread["wchan"] == THROTTLED and thread["state"] == "D"
                                      for thread in unparked(cg.path, proc)), 30), \
            unparked(cg.path, proc)
        assert {thread["pid"] for thread in unparked(cg.path, proc)} == {hog.pid}
        cg.freeze()
        assert cg.wait_frozen(10), unparked(cg.path, proc)
        assert unparked(cg.path, proc) == []
        cg.thaw()
        assert wait_until(lambda: unparked(cg.path, proc), 10)
    finally:
        cg.thaw()
        kill_pid(hog.pid)
        hog.wait()


def test_a_cgroup_left_frozen_by_a_crash_is_thawed_at_start(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("crash", 256 * MiB)
    assert isinstance(cg, V2MemoryCgroup)
    log = tmp_path / "hog.log"
    hog = start_in_cgroup(cg, hog_argv(log, target=16, rate=100, count=100_000))
    try:
        assert wait_until(lambda: last_count(log) > 5, 60)
        # What the daemon does before cgroup.freeze, then "crashes" with the cgroup frozen: the
        # ledger entry names an owner process that is gone.
        store.mkdir(mode=0o700)
        gone = subprocess.Popen(["true"])
        gone.wait()
        FrozenLedger(store / FROZEN_LEDGER, owner=gone.pid).record_cgroup(cg.path)
        cg.freeze()
        assert cg.wait_frozen(5)
        mark = last_count(log)
        proc = DaemonProcess(store, tmp_path / "daemon.log", "--cgroup", str(cg.path))
        try:
            thawed = proc.wait_event("victim.thawed_after_crash", timeout=60)[0]
            assert str(cg.path) in thawed["thawed"]
            assert wait_until(lambda: not cg.is_frozen(), 10)
            assert wait_until(lambda: last_count(log) > mark + 5, 30), "hog still stuck"
        finally:
            proc.stop()
    finally:
        cg.thaw()
        kill_pid(hog.pid)
        hog.wait()


def test_a_refused_checkpoint_backs_off_instead_of_looping(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The guard's memory.high holds a job that cannot be checkpointed (here the store's
    budget has no room): memory.events wakes the loop again at once, and the guard froze,
    refused and thawed it ten times a second (the host lane: 597 refusals in 60 s). Now each
    try that settles nothing is followed by a longer wait (action.backoff), and the job runs
    on, never left stopped."""
    cg = cgroups.make("budget", 128 * MiB)
    config = tmp_path / "budget.toml"
    config.write_text('[daemon]\nstore_max_size = "1M"\n\n'
                      f'[[guard]]\ncgroups = ["{cg.path}"]\nthreshold = "70%"\n')
    hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=110, rate=100,
                                       count=100_000))
    try:
        with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
            backoffs = guard.wait_event("action.backoff", count=3, timeout=120)
            assert [b["retry_in_s"] for b in backoffs[:3]] == [2.0, 4.0, 8.0], backoffs
            refused = guard.events("checkpoint.refused")
            assert refused, "every try refused (the store's budget, or its free space)"
            assert len(refused) <= 4, f"{len(refused)} refusals for 3 waits: a loop"
            assert hog.poll() is None, "the job was lost"
            assert not guard.events("checkpoint.done")
        state = Path(f"/proc/{hog.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "T", "the job was left stopped"
    finally:
        kill_pid(hog.pid)
        hog.wait(timeout=30)
