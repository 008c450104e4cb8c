"""One restore of a checkpoint at a time, whatever the path: two `oomguard restore` of the
same checkpoint started together (an `oomguard exec` job, which CRIU could restore twice, as
its PIDs live in a namespace of their own) bring back exactly one copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from tests.helpers import (
    HOG,
    REPO,
    CgroupFactory,
    kill_pid,
    last_count,
    oomguard_argv,
    run_oomguard,
    start_in_cgroup,
    wait_until,
)


def namespace_init(cgroup_procs: list[int]) -> int | None:
    reader = ProcReader()
    for info in reader.processes(cgroup_procs):
        if info.is_pidns_init:
            return info.pid
    return None


def test_two_restores_at_once_bring_back_one_copy(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("once", None)
    log = tmp_path / "hog.log"
    wrapper = start_in_cgroup(None, [*oomguard_argv(store), "exec", "--cgroup", str(cg.path),
                                     "--", sys.executable, str(HOG), "--log", str(log),
                                     "--target", "32", "--rate", "200", "--count", "100000",
                                     "--tick", "0.01"], cwd=tmp_path)
    restored: list[int] = []
    try:
        init = wait_until(lambda: namespace_init(cg.procs()), 10)
        assert init, "no namespace init in the cgroup"
        assert wait_until(lambda: last_count(log) > 20, 30)
        result = run_oomguard(store, "checkpoint", str(init))
        assert result.returncode == 0, result.stderr
        checkpoint_id = result.stdout.strip()
        both = [subprocess.Popen(oomguard_argv(store, "restore", checkpoint_id), cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 stdin=subprocess.DEVNULL) for _ in range(2)]
        outcomes = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read())  # type: ignore[union-attr]
                    for p in both]
        restored = [int(out.strip()) for code, out, _ in outcomes if code == 0]
        assert len(restored) == 1, outcomes
        refused = next(err for code, _, err in outcomes if code != 0)
        assert "being restored right now" in refused or "already restored" in refused, refused
        assert wait_until(lambda: len([p for p in cg.procs()
                                       if ProcReader().process(p).is_pidns_init]) == 1, 10)
        mark = last_count(log)
        assert wait_until(lambda: last_count(log) > mark + 5, 20)
        assert len([p for p in cg.procs() if ProcReader().process(p).is_pidns_init]) == 1
        assert Store(store).get(checkpoint_id).state == "restored"
    finally:
        for pid in restored:
            kill_pid(pid)
        wrapper.wait(timeout=10)
