"""Fault drills on the real kernel with the real CRIU. The assertion is always the same: no
process is lost without a complete checkpoint on disk or a logged kill the config asked for."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

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
    run_oomguard,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
FORKER = REPO / "tests" / "workloads" / "forker.py"


def test_criu_killed_mid_dump_leaves_the_victim_running(cgroups: CgroupFactory, store: Path,
                                                        tmp_path: Path) -> None:
    """CRIU outlives its timeout half way through a ~500 MiB dump and is SIGKILLed."""
    cg = cgroups.make("criukill", 1024 * MiB)
    config = tmp_path / "kill.toml"
    config.write_text(f'[criu]\ntimeout = "300ms"\n\n[[guard]]\ncgroups = ["{cg.path}"]\n'
                      'threshold = "50%"\nactions = ["checkpoint"]\n')  # (no page-out after it)
    log = tmp_path / "hog.log"
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(log, target=700, rate=1000, count=100_000, chunk=8))
        try:
            failed = guard.wait_event("checkpoint.failed", timeout=60)[0]
            assert "timed out" in failed["error"] and failed["outcome"] == "thawed"
            mark = last_count(log)
            assert wait_until(lambda: last_count(log) > mark + 20, 20), "victim not running"
            assert hog.poll() is None and proc_state(hog.pid) not in ("T", "t")
        finally:
            kill_pid(hog.pid)
            hog.wait()
    assert not Store(store).partials() and not Store(store).list()
    assert cg.snapshot().oom_kills == 0


def test_victim_exiting_at_the_threshold(cgroups: CgroupFactory, store: Path,
                                         tmp_path: Path) -> None:
    """The hog exits right as it crosses: checkpointed if caught, otherwise gone; either way
    the daemon goes on and the store stays consistent."""
    cg = cgroups.make("exits", 256 * MiB)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
        guard.wait_event("guard.armed")
        # 56 steps of 4 MiB = 224 MiB (87%), then done.
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=224, rate=1000,
                                           count=56))
        code = hog.wait(timeout=30)
        time.sleep(1)
        assert guard.handle.poll() is None
        done = guard.events("checkpoint.done")
        assert (code == -signal.SIGKILL and len(done) == 1) or (code == 0 and not done)
    assert not Store(store).partials()
    assert cg.snapshot().oom_kills == 0


def test_victim_forking_during_the_freeze(cgroups: CgroupFactory, store: Path,
                                          tmp_path: Path) -> None:
    cg = cgroups.make("forker", 256 * MiB)
    log = tmp_path / "forker.log"
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
        guard.wait_event("guard.armed")
        proc = start_in_cgroup(cg, [sys.executable, str(FORKER), str(log), "400"])
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        assert proc.wait(timeout=10) == -signal.SIGKILL
    assert done["pid"] == proc.pid
    assert wait_until(lambda: not cg.procs(), 10), "a forked child escaped the checkpoint"
    big = cgroups.make("forkerbig", 1024 * MiB)
    result = run_oomguard(store, "restore", done["id"], "--cgroup", str(big.path))
    assert result.returncode == 0, result.stderr
    try:
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 20, 20)
    finally:
        for pid in big.procs():
            kill_pid(pid)


def test_two_cgroups_crossing_at_the_same_moment(cgroups: CgroupFactory, store: Path,
                                                 tmp_path: Path) -> None:
    first, second = cgroups.make("twin1", 256 * MiB), cgroups.make("twin2", 256 * MiB)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(first.path), "--cgroup",
                str(second.path)) as guard:
        guard.wait_event("guard.armed", count=2)
        hogs = [start_in_cgroup(cg, hog_argv(tmp_path / f"{cg.path.name}.log", target=400,
                                             rate=1000, count=100_000)) for cg in (first, second)]
        guard.wait_event("checkpoint.done", count=2, timeout=60)
        for hog in hogs:
            assert hog.wait(timeout=10) == -signal.SIGKILL
    assert sorted(m.pid for m in Store(store).list()) == sorted(h.pid for h in hogs)
    assert first.snapshot().oom_kills == 0 and second.snapshot().oom_kills == 0


def test_twenty_hogs_in_twenty_cgroups_within_a_second(cgroups: CgroupFactory, store: Path,
                                                       tmp_path: Path) -> None:
    """20 hogs saturate both cores while the daemon has 20 victims to stop at once: with
    oom_kill_disable (v1) a hog that reaches its limit first waits for oomguard instead of
    being OOM-killed."""
    groups = [cgroups.make(f"swarm{i}", 96 * MiB) for i in range(20)]
    config = tmp_path / "swarm.toml"
    config.write_text("[[guard]]\ncgroups = [" + ", ".join(f'"{g.path}"' for g in groups)
                      + "]\noom_kill_disable = true\n")
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.armed", count=20)
        hogs = [start_in_cgroup(g, hog_argv(tmp_path / f"h{i}.log", target=160, rate=400,
                                            count=100_000)) for i, g in enumerate(groups)]
        guard.wait_event("checkpoint.done", count=20, timeout=180)
        codes = [hog.wait(timeout=30) for hog in hogs]
    assert codes == [-signal.SIGKILL] * 20
    assert sorted(m.pid for m in Store(store).list()) == sorted(h.pid for h in hogs)
    assert [g.snapshot().oom_kills for g in groups] == [0] * 20
    assert not any(g.oom_kill_disabled() for g in groups), "oom_kill_disable not put back"


def test_hostile_process_names_and_command_lines(cgroups: CgroupFactory, store: Path,
                                                 tmp_path: Path) -> None:
    """A comm of `foo) Z 1 (`, a command line with newlines and 20 kB of arguments: parsed,
    checkpointed, listed and restored like any other."""
    cg = cgroups.make("hostile", None)
    log = tmp_path / "hostile.log"
    script = ("import sys, time\n"
              "open('/proc/self/comm', 'w').write('foo) Z 1 (')\n"
              "log = open(sys.argv[1], 'a', buffering=1)\n"
              "n = 0\n"
              "while True:\n    n += 1\n    log.write(f'{n}\\n')\n    time.sleep(0.01)\n")
    argv = [sys.executable, "-c", script, str(log), "line\nbreak", "x" * 20_000]
    proc = start_in_cgroup(cg, argv)
    try:
        assert wait_until(lambda: last_count(log) > 10, 10)
        result = run_oomguard(store, "checkpoint", str(proc.pid))
        assert result.returncode == 0, result.stderr
        checkpoint_id = result.stdout.strip()
        proc.wait(timeout=10)
        meta = Store(store).get(checkpoint_id)
        assert meta.comm == "foo) Z 1 (" and "line\nbreak" in meta.command
        listed = run_oomguard(store, "list")
        assert listed.returncode == 0 and checkpoint_id in listed.stdout
        restored = run_oomguard(store, "restore", checkpoint_id)
        assert restored.returncode == 0, restored.stderr
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 5, 10)
        kill_pid(int(restored.stdout.strip()))
    finally:
        kill_pid(proc.pid)
