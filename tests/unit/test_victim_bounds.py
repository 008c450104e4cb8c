"""Victim trees as people start jobs: bounded by session processes (a shell, a multiplexer, an
ssh session, a desktop session), whole below them (make with its compilers), and known unfit
for a checkpoint before anything is stopped (a traced task, a protected one below the root)."""

from __future__ import annotations

import dataclasses

from oomguard.policy.victims import ProcessTree, build_trees, system_candidates, system_tree
from oomguard.sense.procfs import ProcessInfo
from tests.unit._support import proc_info

NONE: frozenset[int] = frozenset()
PTS = 34817


def p(pid: int, ppid: int, comm: str, *argv: str, rss: float = 1, tty: int = PTS,
      **more: object) -> ProcessInfo:
    return dataclasses.replace(proc_info(pid, ppid, rss, comm=comm), cmdline=argv or (comm,),
                               tty_nr=tty, **more)  # type: ignore[arg-type]


def by_root(trees: list[ProcessTree]) -> dict[int, tuple[int, ...]]:
    return {t.root.pid: t.pids for t in trees}


# A terminal: tmux's server, a pane's shell, the jobs typed at its prompt.
TMUX = p(100, 1, "tmux: server", "tmux", "new", "-d", tty=0)
PANE = p(101, 100, "bash", "bash", "--norc", "-i")
TRAIN = p(110, 101, "python3", "python3", "train.py", rss=500)
MAKE = p(120, 101, "make", "make", "-j2", rss=5)
CC1 = p(121, 120, "cc1", "cc1", "big.c", rss=300)
CC2 = p(122, 120, "cc1", "cc1", "small.c", rss=100)


def test_the_shell_and_the_multiplexer_are_never_members_their_jobs_are_trees() -> None:
    trees = build_trees([TMUX, PANE, TRAIN, MAKE, CC1, CC2], NONE)
    assert by_root(trees) == {110: (110,), 120: (120, 121, 122)}  # make keeps its compilers
    assert all(not t.unfit for t in trees)


def test_take_sessions_is_the_old_tree() -> None:
    trees = build_trees([TMUX, PANE, TRAIN, MAKE, CC1, CC2], NONE, take_sessions=True)
    assert by_root(trees) == {100: (100, 101, 110, 120, 121, 122)}


def test_a_script_run_by_a_shell_stays_one_job() -> None:
    script = p(130, 101, "bash", "bash", "run.sh")
    step = p(131, 130, "python3", "python3", "step.py", rss=200)
    sh_c = p(132, 131, "sh", "/bin/sh", "-c", "sort big")
    assert by_root(build_trees([PANE, script, step, sh_c], NONE)) == {130: (130, 131, 132)}


def test_ssh_login_and_nested_shells() -> None:
    sshd = p(200, 1, "sshd", "/usr/sbin/sshd", "-D", tty=0)
    session = p(201, 200, "sshd-session", "sshd-session: alice@pts/1", tty=0)
    login = p(202, 201, "bash", "-bash")
    inner = p(203, 202, "bash", "bash")  # a shell typed at the prompt
    job = p(204, 203, "python3", "python3", "x.py", rss=100)
    assert by_root(build_trees([sshd, session, login, inner, job], NONE)) == {204: (204,)}


def test_a_tree_holding_a_session_below_its_root_is_no_candidate() -> None:
    """`script` (or a terminal emulator) above an interactive shell: dumping or killing it
    would end the shell; the job under the shell is still a tree."""
    script = p(300, 101, "script", "script", "-q", "log")
    shell = p(301, 300, "bash", "bash", "-i")
    job = p(302, 301, "python3", "python3", "x.py", rss=100)
    assert by_root(build_trees([PANE, script, shell, job], NONE)) == {302: (302,)}


def test_an_exec_job_with_a_shell_inside_is_dumped_whole_from_its_init() -> None:
    init = p(400, 101, "python3", "python3", "-I", "nsinit.py", nspid=(400, 1))
    shell = p(401, 400, "bash", "bash", "-i", nspid=(401, 2))
    job = p(402, 401, "python3", "python3", "x.py", rss=100, nspid=(402, 3))
    assert by_root(build_trees([PANE, init, shell, job], NONE)) == {400: (400, 401, 402)}


def test_a_traced_task_is_a_member_and_makes_its_tree_unfit() -> None:
    strace = p(500, 101, "strace", "strace", "-f", "-o", "/dev/null", "python3", "hog.py")
    hog = p(501, 500, "python3", "python3", "hog.py", rss=250, tracer_pid=500)
    [tree] = build_trees([PANE, strace, hog], NONE)
    assert tree.pids == (500, 501) and tree.rss_bytes > 250 << 20
    assert tree.unfit == ("pid 501 (python3) is traced by pid 500 (strace): CRIU cannot dump "
                          "a traced task")


def test_a_traced_task_on_its_way_out_keeps_its_tree_unfit() -> None:
    """Killed by the kernel's OOM killer: until it is gone its tracer is no job of its own."""
    strace = p(510, 101, "strace", "strace", "-f", "python3", "hog.py")
    dying = dataclasses.replace(p(511, 510, "python3", rss=0, tracer_pid=510), cmdline=())
    [tree] = build_trees([PANE, strace, dying], NONE)
    assert tree.pids == (510,)
    assert tree.unfit.startswith("pid 511 (python3) is traced by pid 510 (strace)")


def test_a_task_being_dumped_by_oomguard_is_protected_not_unfit() -> None:
    criu = p(600, 1, "criu", "criu", "dump", tty=0)
    job = p(601, 101, "python3", "python3", "x.py", tracer_pid=600)
    assert build_trees([PANE, criu, job], frozenset({600})) == []


def test_a_protected_task_below_the_root_makes_the_tree_unfit() -> None:
    root = p(700, 101, "python3", "python3", "serve.py", rss=100)
    keeper = p(701, 700, "keeper", "keeper", oom_score_adj=-1000)
    kid = p(702, 701, "worker", "worker", rss=50)
    trees = {t.root.pid: t for t in build_trees([PANE, root, keeper, kid], NONE)}
    assert trees[700].pids == (700,)
    assert trees[700].unfit == ("pid 701 (keeper) below it is never a victim (opted out of OOM "
                                "handling (oom_score_adj -1000)), and a dump of the tree would "
                                "take it")
    assert trees[702].pids == (702,) and not trees[702].unfit


def test_a_zombie_child_is_no_reason_for_unfit() -> None:
    root = p(800, 101, "python3", "python3", "x.py")
    zombie = p(801, 800, "sh", "sh", state="Z")
    [tree] = build_trees([PANE, root, zombie], NONE)
    assert tree.pids == (800,) and not tree.unfit


def test_system_rules_never_take_a_session_process_nor_a_tree_holding_one() -> None:
    terminal = p(900, 1, "xterm", "xterm", rss=80, tty=0)
    shell = p(901, 900, "bash", "bash", rss=5)
    job = p(902, 901, "python3", "python3", "x.py", rss=400)
    tmux = p(903, 1, "tmux: server", "tmux", rss=900, tty=0)
    procs = [terminal, shell, job, tmux]
    assert by_root(system_candidates(procs, NONE)) == {902: (902,)}
    assert system_tree(900, procs, NONE) is None
    assert system_tree(902, procs, NONE) == system_candidates(procs, NONE)[0]
    assert by_root(system_candidates(procs, NONE, take_sessions=True)) == {
        903: (903,), 902: (902,), 900: (900, 901, 902), 901: (901, 902)}
