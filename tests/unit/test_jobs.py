"""The PID a person sees (issue 25, item 2): a process inside an `oomguard exec` job stands for
the whole job, from its PID namespace's init, wherever a tree is chosen (policy/jobs.py,
lifecycle/jobroot.py, the service's `checkpoint PID` and `show PID`); and the job's own command
(model/jobcommand.py)."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.cgroup.mounts import CgroupLayout
from oomguard.control.service import PermissionDenied, Service
from oomguard.lifecycle.checkpoint import tree_of
from oomguard.lifecycle.jobroot import job_init, job_root, refuse_partial_job
from oomguard.model.errors import CheckpointFailed, FailedCheckpoint, UnknownCheckpoint
from oomguard.model.jobcommand import job_command, job_command_from_text, nsinit_job_argv
from oomguard.policy.jobs import (
    below_namespace_init,
    job_fields,
    lift_to_jobs,
    main_process,
    namespace_init,
    partial_job_reason,
    within,
)
from oomguard.policy.rights import foreign_task
from oomguard.policy.victims import ProcessTree, build_trees, system_candidates
from oomguard.sense.procfs import ProcessInfo, ProcReader
from oomguard.store.checkpoints import CheckpointMeta, Store
from oomguard.store.ids import names_a_pid, newest_holding
from tests.unit._support import FakeProc, fake_proc_tree, proc_info

NSINIT = ("/usr/bin/python3", "-I", "/opt/oomguard/terminal/nsinit.py")
NO_CGROUPS = CgroupLayout(memory_v1=None, unified=None, unified_controllers=())
MiB = 1 << 20

# An exec job as /proc shows it: the wrapper (700, outside), its init (701, PID 1 of the
# namespace), CMD (702, PID 2), CMD's child (703, PID 3); and a plain process (800).
WRAPPER, INIT, CMD, CMD_CHILD, PLAIN = 700, 701, 702, 703, 800


def exec_job(*, init_adj: int = 0, init_tracer: int = 0, cmd_rss: float = 300,
             child_rss: float = 50) -> list[ProcessInfo]:
    wrapper = replace(proc_info(WRAPPER, 600, 20), cmdline=(
        "/usr/bin/python3", "-m", "oomguard", "exec", "--", "python3", "train.py"))
    init = replace(proc_info(INIT, WRAPPER, 9, nspid=(INIT, 1)),
                   cmdline=(*NSINIT, "--tty-fd", "3", "--", "python3", "train.py", "--epochs",
                            "3"),
                   oom_score_adj=init_adj, tracer_pid=init_tracer)
    cmd = replace(proc_info(CMD, INIT, cmd_rss, nspid=(CMD, 2)),
                  cmdline=("python3", "train.py", "--epochs", "3"))
    child = proc_info(CMD_CHILD, CMD, child_rss, nspid=(CMD_CHILD, 3))
    return [wrapper, init, cmd, child, proc_info(PLAIN, 600, 100)]


def by_pid(processes: list[ProcessInfo]) -> dict[int, ProcessInfo]:
    return {p.pid: p for p in processes}


# -- the lift to the init ---------------------------------------------------------------------


def test_a_process_below_a_namespace_init_is_told_from_the_init_and_the_host() -> None:
    procs = by_pid(exec_job())
    assert [below_namespace_init(procs[p]) for p in (WRAPPER, INIT, CMD, CMD_CHILD)] == [
        False, False, True, True]
    assert namespace_init(procs[CMD_CHILD], procs) is procs[INIT]
    assert namespace_init(procs[INIT], procs) is procs[INIT]
    assert namespace_init(procs[WRAPPER], procs) is None  # oomguard's own namespace
    del procs[INIT]
    assert namespace_init(procs[CMD_CHILD], procs) is None  # not among those read


def test_a_process_moved_in_with_setns_has_no_init_above_it() -> None:
    """Its parent is outside the namespace (nsenter): the walk stops there."""
    outsider = proc_info(900, 1, 10)
    joined = proc_info(901, 900, 10, nspid=(901, 7))
    assert namespace_init(joined, by_pid([outsider, joined])) is None


def test_a_system_rule_takes_the_whole_job_of_its_largest_process() -> None:
    """The largest process is CMD: the tree taken is the init's, holding CMD and its child."""
    procs = exec_job()
    heads = system_candidates(procs, frozenset())
    assert heads[0].root.pid == CMD  # earlyoom's choice: the process itself
    lifted = lift_to_jobs(heads, procs, frozenset())
    job = lifted[0]
    assert job.root.pid == INIT and job.pids == (INIT, CMD, CMD_CHILD)
    # CMD and its child were two heads; they are one job now, listed once
    assert [t.root.pid for t in lifted].count(INIT) == 1
    assert not any(below_namespace_init(t.root) for t in lifted)


@pytest.mark.parametrize("why", ["oom_score_adj", "traced", "oomguard's", "absent"])
def test_a_job_whose_init_cannot_be_taken_is_left_for_the_checkpoint_to_refuse(why: str) -> None:
    procs = exec_job(init_adj=-1000 if why == "oom_score_adj" else 0,
                     init_tracer=4321 if why == "traced" else 0)
    protected = frozenset({INIT}) if why == "oomguard's" else frozenset()
    if why == "absent":  # e.g. outside the victim cgroups the rule reads
        procs = [p for p in procs if p.pid != INIT]
    lifted = lift_to_jobs(system_candidates(procs, protected), procs, protected)
    if why == "traced":  # a traced task is a member that makes its tree unfit: refused so
        assert lifted[0].root.pid == INIT and lifted[0].unfit
        return
    assert lifted[0].root.pid == CMD  # as chosen: the checkpoint refuses it, saying why


def test_a_cgroup_rule_roots_the_job_at_its_init_or_below_it_only_when_the_init_is_out() -> None:
    procs = exec_job()
    in_cgroup = [p for p in procs if p.pid != WRAPPER]
    assert {t.root.pid for t in build_trees(in_cgroup, frozenset())} == {INIT, PLAIN}
    without_init = [p for p in in_cgroup if p.pid != INIT]
    (cmd_tree,) = [t for t in build_trees(without_init, frozenset()) if t.root.pid != PLAIN]
    assert cmd_tree.root.pid == CMD and below_namespace_init(cmd_tree.root)


@pytest.mark.parametrize(("init_found", "untouchable", "init_cgroup", "expected"), [
    (False, None, None, "its init is not among its ancestors"),
    (True, "process 701 (p701) in the tree of 701 is traced by process 9 (a debugger...)",
     "/jobs/a", "the init cannot be taken: process 701 (p701) in the tree of 701 is traced"),
    (True, None, "/elsewhere", "the init, process 701, is outside the cgroup /jobs/a "
     "(it is in /elsewhere)"),
    (True, None, "/jobs/a/inner", "checkpoint the whole job, from its init "
     "(`oomguard checkpoint 701`)"),
])
def test_why_a_tree_inside_a_job_is_refused(init_found: bool, untouchable: str | None,
                                             init_cgroup: str | None, expected: str) -> None:
    procs = by_pid(exec_job())
    reason = partial_job_reason(procs[CMD], procs[INIT] if init_found else None, init_cgroup,
                                "/jobs/a", untouchable)
    assert reason.startswith("process 702 (p702) is inside a PID namespace (an `oomguard exec` "
                             "job), which CRIU dumps only whole, from the namespace's init")
    assert expected in reason


def test_cgroup_paths_within() -> None:
    assert within("/jobs/a", "/jobs/a") and within("/jobs/a/b", "/jobs/a/")
    assert within("/anything", "/") and not within("/jobs/ab", "/jobs/a")


# -- read from /proc: job_root, the checkpoint's refusal -------------------------------------

NSINIT_CMDLINE = b"\0".join(x.encode() for x in (*NSINIT, "--", "python3", "train.py")) + b"\0"


def fake_job(tmp_path: Path, *, init_cgroup: str = "12:memory:/jobs/a\n",
             init_uid: int = 1000) -> ProcReader:
    root = fake_proc_tree(tmp_path / "proc", [
        FakeProc(WRAPPER, 1, comm="python3", children={WRAPPER: [INIT]}),
        FakeProc(INIT, WRAPPER, comm="python3", nspid=(INIT, 1), cmdline=NSINIT_CMDLINE,
                 children={INIT: [CMD]}, cgroup=init_cgroup, uid=init_uid),
        FakeProc(CMD, INIT, comm="train", nspid=(CMD, 2), children={CMD: [CMD_CHILD]},
                 cmdline=b"python3\0train.py\0"),
        FakeProc(CMD_CHILD, CMD, comm="worker", nspid=(CMD_CHILD, 3)),
        FakeProc(PLAIN, 1, comm="plain"),
    ])
    return ProcReader(root)


def test_job_root_lifts_any_process_of_a_job_to_its_init(tmp_path: Path) -> None:
    proc = fake_job(tmp_path)
    assert [job_root(proc, pid) for pid in (CMD, CMD_CHILD, INIT, WRAPPER, PLAIN)] == [
        INIT, INIT, INIT, WRAPPER, PLAIN]
    assert job_root(proc, CMD, frozenset({INIT})) == CMD  # a protected init: not taken
    init = job_init(proc, proc.process(CMD_CHILD))
    assert init is not None and init.pid == INIT


def test_the_checkpoint_refuses_a_tree_rooted_inside_a_job_before_stopping_it(
        tmp_path: Path) -> None:
    proc = fake_job(tmp_path, init_cgroup="12:memory:/elsewhere\n")
    cgroup = SimpleNamespace(rel_path="/jobs/a")
    with pytest.raises(CheckpointFailed) as refused:
        refuse_partial_job(tree_of(CMD, proc), cgroup, proc)  # type: ignore[arg-type]
    assert refused.value.outcome == FailedCheckpoint.UNTOUCHED
    assert str(refused.value).startswith("checkpoint of 702 refused before stopping it: "
                                         "process 702 (train) is inside a PID namespace")
    assert "the init, process 701, is outside the cgroup /jobs/a (it is in /elsewhere)" in \
        str(refused.value)
    # the job's own tree, and trees outside any namespace, go ahead
    refuse_partial_job(tree_of(INIT, proc), cgroup, proc)  # type: ignore[arg-type]
    refuse_partial_job(tree_of(PLAIN, proc), None, proc)


# -- on demand: `oomguard checkpoint PID` and `show PID` through the service ------------------


def make_meta(checkpoint_id: str, uid: int, created: float, pids: list[int], **more: Any,
              ) -> CheckpointMeta:
    return CheckpointMeta(
        id=checkpoint_id, pid=pids[0], pids=pids, command="python3 job.py", comm="python3",
        uid=uid, user=f"user{uid}", cgroup="/jobs/a", cgroup_version=1, rss_bytes=MiB,
        reason="test", criu_version="4.2", created=created, **more)


def service_over(tmp_path: Path, proc: ProcReader) -> tuple[Service, list[ProcessTree]]:
    taken: list[ProcessTree] = []

    def checkpoint(tree: ProcessTree, cgroup: Any, why: str, requester: int | None = None,
                   headroom: int | None = None, rights_of: int | None = None) -> Any:
        taken.append(tree)
        meta = make_meta("taken", tree.root.uid, 1.0, list(tree.pids), **job_fields(tree))
        return SimpleNamespace(meta=meta, timings=SimpleNamespace(
            total_s=1.0, freeze_s=0.001, dump_s=0.9, commit_s=0.1))

    service = Service(Store(tmp_path / "store"), restorer=None,  # type: ignore[arg-type]
                      checkpointer=SimpleNamespace(checkpoint=checkpoint),  # type: ignore[arg-type]
                      layout=NO_CGROUPS, proc=proc)
    return service, taken


@pytest.mark.parametrize("asked", [CMD, CMD_CHILD, INIT])
def test_checkpoint_pid_takes_the_whole_job_and_says_which(tmp_path: Path, asked: int) -> None:
    service, taken = service_over(tmp_path, fake_job(tmp_path))
    reply = service.checkpoint(1000, asked)
    (tree,) = taken
    assert tree.root.pid == INIT and set(tree.pids) == {INIT, CMD, CMD_CHILD}
    assert reply["asked_pid"] == asked and reply["pid"] == INIT
    assert reply["job_pid"] == CMD and reply["job_command"] == "python3 train.py"


def test_a_lifted_tree_must_be_the_callers_whole(tmp_path: Path) -> None:
    """The init belongs to someone else: the user's own CMD does not make the job theirs."""
    service, taken = service_over(tmp_path, fake_job(tmp_path, init_uid=0))
    with pytest.raises(PermissionDenied, match=r"^process 701 \(the init of the job of process "
                                               r"702\) is not yours$"):
        service.checkpoint(1000, CMD)
    assert taken == []
    tree = tree_of(INIT, fake_job(tmp_path / "again", init_uid=1000))
    assert foreign_task(tree, 1000) is None


def test_show_pid_finds_the_newest_checkpoint_whose_tree_held_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    metas = [make_meta("old", 1000, 100.0, [INIT, CMD], job_pid=CMD),
             make_meta("new", 1000, 200.0, [INIT, CMD, CMD_CHILD], job_pid=CMD),
             make_meta("bobs", 1001, 300.0, [INIT, CMD]),
             make_meta("moved", 1000, 50.0, [900], restored_pid=CMD_CHILD + 100)]
    for meta in metas:
        _images, lock_fd = store.begin(meta)
        os.close(lock_fd)
        store.commit(meta)
    # the live restored job of "moved": its init 803 (the restored root), CMD 804
    proc = ProcReader(fake_proc_tree(tmp_path / "proc", [
        FakeProc(CMD_CHILD + 100, 1, nspid=(CMD_CHILD + 100, 1), children={803: [804]}),
        FakeProc(CMD_CHILD + 101, CMD_CHILD + 100, nspid=(CMD_CHILD + 101, 2))]))
    service = Service(store, restorer=None, checkpointer=None,  # type: ignore[arg-type]
                      layout=NO_CGROUPS, proc=proc)
    assert service.show(1000, str(CMD))["id"] == "new"
    assert service.show(0, str(CMD))["id"] == "bobs"  # root sees every checkpoint
    assert service.show(1000, str(CMD_CHILD + 100))["id"] == "moved"  # its restored root
    assert service.show(1000, str(CMD_CHILD + 101))["id"] == "moved"  # and CMD under it
    with pytest.raises(UnknownCheckpoint, match="no checkpoint of yours of a tree that held "
                                                "process 4242"):
        service.show(1000, "4242")
    assert newest_holding(INIT, metas) == "bobs" and names_a_pid(str(CMD))


# -- the job's command and main process -------------------------------------------------------


@pytest.mark.parametrize(("cmdline", "argv"), [
    ((*NSINIT, "--", "python3", "-c", "import x\nx.run()"), ("python3", "-c", "import x\nx.run()")),
    ((*NSINIT, "--tty-fd", "3", "--cgroup-procs", "/sys/fs/cgroup/memory/a b/cgroup.procs", "--",
      "sleep", "--", "1"), ("sleep", "--", "1")),
    (("python3", "nsinit.py", "--", "make"), ("make",)),
    (("python3", "train.py", "--", "nsinit.py"), None),  # not nsinit's
    ((*NSINIT, "--"), None),
    ((*NSINIT, "--bogus", "--", "x"), None),
])
def test_nsinit_job_argv(cmdline: tuple[str, ...], argv: tuple[str, ...] | None) -> None:
    assert nsinit_job_argv(cmdline) == argv


def test_an_older_checkpoints_job_command_is_derived_from_its_command() -> None:
    joined = "/venv/bin/python -I /repo/oomguard/terminal/nsinit.py --tty-fd 3 -- python3 -c " \
             "\nimport time\nprint(1)"
    assert job_command_from_text(joined) == "python3 -c \nimport time\nprint(1)"
    assert job_command_from_text("python3 train.py -- x") == "python3 train.py -- x"
    assert job_command("", joined) == "python3 -c \nimport time\nprint(1)"
    assert job_command("recorded", joined) == "recorded"


def test_job_fields_name_cmd_and_its_host_pid() -> None:
    procs = by_pid(exec_job())
    tree = ProcessTree(root=procs[INIT], members=(procs[INIT], procs[CMD], procs[CMD_CHILD]))
    assert job_fields(tree) == {"job_command": "python3 train.py --epochs 3", "job_pid": CMD}
    assert main_process(tree) is procs[CMD]
    plain = ProcessTree(root=procs[PLAIN], members=(procs[PLAIN],))
    assert job_fields(plain) == {"job_command": "/bin/p800", "job_pid": PLAIN}
    # CMD gone (it exec'd a daemon that forked): the oldest child of the init
    orphan = replace(procs[CMD_CHILD], ppid=INIT)
    left = ProcessTree(root=procs[INIT], members=(procs[INIT], orphan))
    assert main_process(left) is orphan
    assert asdict(make_meta("x", 1, 1.0, [1], **job_fields(tree)))["job_pid"] == CMD


def test_a_system_rule_reading_its_ranking_reads_the_jobs_init_too(tmp_path: Path) -> None:
    """With a standing ranking only the largest processes are read in full at the crossing:
    the init of a chosen process's job is read too, and the tree taken is the init's."""
    from oomguard.daemon.examining import Examiner
    from oomguard.sense.ranking import ProcessRanking

    small = [FakeProc(pid, 1, rss_kib=20 << 10) for pid in range(900, 940)]
    procs = [FakeProc(WRAPPER, 1, rss_kib=20 << 10, children={WRAPPER: [INIT]}),
             FakeProc(INIT, WRAPPER, nspid=(INIT, 1), cmdline=NSINIT_CMDLINE, rss_kib=9 << 10,
                      children={INIT: [CMD]}),
             FakeProc(CMD, INIT, nspid=(CMD, 2), rss_kib=300 << 10, children={CMD: [CMD_CHILD]}),
             FakeProc(CMD_CHILD, CMD, nspid=(CMD_CHILD, 3), rss_kib=50 << 10), *small]
    root = fake_proc_tree(tmp_path / "proc", procs)
    for p in procs:
        pages = (p.rss_kib or 0) // 4
        (root / str(p.pid) / "statm").write_text(f"{pages * 2} {pages} 10 1 0 {pages} 0\n")

    examiner = Examiner.__new__(Examiner)  # only what a system rule's ranking path reads
    examiner.protected_among = lambda processes: frozenset()
    examiner.proc = ProcReader(root)
    examiner.ranking = ProcessRanking(root, page_size=4096)
    examiner.ranking.refresh()
    ranking = examiner.ranking.current()
    assert ranking is not None and INIT not in ranking.top()  # too small to be read in full
    processes = examiner._ranked_processes(take_sessions=False)
    (init,) = [p for p in processes if p.pid == INIT]
    assert init.is_pidns_init  # read in full, not a stand-in
    trees = lift_to_jobs(system_candidates(processes, frozenset()), processes, frozenset())
    assert trees[0].root.pid == INIT and set(trees[0].pids) == {INIT, CMD, CMD_CHILD}
    fresh = examiner._refresh_tree(trees[0], take_sessions=False)
    assert fresh is not None and fresh.root.pid == INIT
    assert set(fresh.pids) == {INIT, CMD, CMD_CHILD}
