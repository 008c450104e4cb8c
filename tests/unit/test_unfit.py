"""oomguard.policy.unfit: CRIU's errors that no retry changes, and the marks that keep a tree
no checkpoint can take from being chosen again while it lives."""

from __future__ import annotations

import dataclasses

import pytest

from oomguard.policy.unfit import UnfitMarks, lasting_failure
from oomguard.policy.victims import ProcessTree
from tests.unit._support import proc_info

# Error lines as CRIU 4.2.1 writes them (from real dump logs on this project's host: a
# `strace -f sleep` tree, a python holding a perf_event fd).
UNSEIZABLE = ("(00.001740) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 4242 "
              "found, state S, err -1/10")
PERF = ("(00.025887) Error (criu/files-ext.c:94): Can't dump file 3 of that type [600] (anon "
        "anon_inode:[perf_event])")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (f"criu dump exited with status 1\n{UNSEIZABLE}\n(00.01) Error (criu/cr-dump.c:2094): "
         "Dumping FAILED.", "pid 4242 could not be seized: another tracer holds it (a "
         "debugger, strace), or ptrace is not allowed on it"),
        (UNSEIZABLE.replace("state S", "state t"), "pid 4242 could not be seized: another "
         "tracer holds it (a debugger, strace), or ptrace is not allowed on it"),
        (PERF, "an open file of a kind CRIU cannot dump (fd 3: anon anon_inode:[perf_event])"),
        ("Error (criu/sk-unix.c:881): Can't dump half of stream unix connection. name: x; "
         "peer name: y", "a unix socket connected to a process outside the tree"),
        ("Error (criu/sk-inet.c:200): Connected TCP socket, consider using --tcp-established "
         "option.", "an established TCP connection (CRIU is not set up to dump one)"),
        ("Error (criu/namespaces.c:1117): Can't dump a pid namespace without the process init",
         "a process of a PID namespace whose init is not in the tree"),
        ("Error (criu/namespaces.c:460): Can't dump nested uts namespace for 77",
         "a nested uts namespace, which CRIU cannot dump"),
        ("Error (criu/files-reg.c:1031): Can't dump ghost file /dev/shm/batch of 123 size, "
         "increase limit", "a deleted, still open file (/dev/shm/batch) larger than CRIU's "
         "ghost file limit"),
    ],
)
def test_lasting_failures_say_why_in_one_line(text: str, reason: str) -> None:
    assert lasting_failure(text) == reason


@pytest.mark.parametrize(
    "text",
    [
        "criu dump timed out after 300s",
        "Error (criu/image.c:100): Can't write: No space left on device",
        # wait4 saw it exit while it was seized: gone, not unfit
        "Error (compel/src/lib/infect.c:262): Unseizable non-zombie 12 found, state R, err 12/0",
        "Error (criu/seize.c:952): Individually stopped threads not supported",
        "Error (criu/cr-dump.c:1545): Dump files (pid: 21444) failed with -1",
        "",
    ],
    ids=["timeout", "enospc", "exited-while-seized", "stopped-threads", "vague", "empty"],
)
def test_failures_that_may_pass_are_not_lasting(text: str) -> None:
    assert lasting_failure(text) is None


def tree(pid: int, starttime: int = 1000, unfit: str = "") -> ProcessTree:
    root = proc_info(pid, starttime=starttime)
    return ProcessTree(root=root, members=(root,), unfit=unfit)


def test_a_marked_tree_is_left_out_while_its_root_lives() -> None:
    alive = {10: 1000, 20: 1000}
    marks = UnfitMarks(lambda pid: alive.get(pid, 0))
    marks.mark(tree(10), "pid 11 is traced")
    kept, left = marks.split([tree(10), tree(20)])
    assert [t.root.pid for t in kept] == [20]
    assert left == ["pid 10 (p10): pid 11 is traced"]
    assert marks.reason(tree(10, starttime=2000)) is None  # another process with that pid
    marks.forget_gone()
    assert len(marks) == 1
    alive[10] = 3000  # pid 10 reused
    marks.forget_gone()
    assert len(marks) == 0 and marks.split([tree(10)])[0] == [tree(10)]


def test_a_tree_refused_for_what_it_no_longer_is_is_a_candidate_again() -> None:
    """A debugger that detaches: the tree is no longer unfit, and read afresh it says so."""
    marks = UnfitMarks(lambda pid: 1000)
    marks.mark(tree(10, unfit="traced"), "traced", known_before=True)
    assert marks.reason(tree(10, unfit="traced")) == "traced"
    assert marks.reason(tree(10), fresh=False) == "traced"  # a ranking's stand-ins cannot tell
    assert marks.reason(tree(10)) is None
    assert len(marks) == 0
    # A CRIU failure is not re-checked: nothing before the dump can tell.
    marks.mark(tree(10), "an open file CRIU cannot dump")
    assert marks.reason(tree(10)) == "an open file CRIU cannot dump"


def test_marks_key_on_the_root_not_the_members() -> None:
    marks = UnfitMarks(lambda pid: 1000)
    marks.mark(tree(10), "x")
    grown = dataclasses.replace(tree(10), members=(proc_info(10), proc_info(11, 10)))
    assert marks.reason(grown) == "x"
