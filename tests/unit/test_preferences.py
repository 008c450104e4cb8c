"""oomguard.policy.preferences: protect / prefer / avoid regexes and session-leader protection."""

from __future__ import annotations

import dataclasses
import re

import pytest

from oomguard.model.patterns import compile_patterns
from oomguard.policy.preferences import Preferences, apply_preferences, is_excluded
from oomguard.policy.victims import ProcessTree
from oomguard.sense.procfs import ProcessInfo
from tests.unit._support import proc_info


def proc(pid: int, ppid: int = 1, *, comm: str | None = None, cmdline: tuple[str, ...] | None = None,
         session: int | None = None, nspid: tuple[int, ...] = ()) -> ProcessInfo:
    """A process that is NOT a session leader unless `session` says so (session defaults to 1)."""
    base = proc_info(pid, ppid, comm=comm, nspid=nspid)
    return dataclasses.replace(base, session=1 if session is None else session,
                               cmdline=base.cmdline if cmdline is None else cmdline)


def tree(root: ProcessInfo, *children: ProcessInfo) -> ProcessTree:
    return ProcessTree(root=root, members=(root, *children))


def prefs(*, prefer: tuple[str, ...] = (), avoid: tuple[str, ...] = (),
          protect: tuple[str, ...] = (), leaders: bool = False) -> Preferences:
    return Preferences(prefer=compile_patterns(prefer), avoid=compile_patterns(avoid),
                       protect=compile_patterns(protect), protect_session_leaders=leaders)


def roots(trees: list[ProcessTree]) -> list[int]:
    return [t.root.pid for t in trees]


# --- compile_patterns ----------------------------------------------------------------------------

def test_compile_patterns_valid() -> None:
    patterns = compile_patterns(["python", r"^java$", r"train\.py"])
    assert all(isinstance(p, re.Pattern) for p in patterns)
    assert [p.pattern for p in patterns] == ["python", r"^java$", r"train\.py"]
    assert compile_patterns([]) == ()
    assert len(compile_patterns(iter(["a", "b"]))) == 2  # any iterable


@pytest.mark.parametrize("bad", ["(", "[a-", "*oops", "a{2,1}"])
def test_compile_patterns_bad_regex_names_it(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        compile_patterns(["fine", bad])
    assert f"bad regular expression {bad!r}" in str(info.value)


@pytest.mark.parametrize("bad", [3, None, b"python", ["python"]])
def test_compile_patterns_non_string(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a regular expression string"):
        compile_patterns(["fine", bad])  # type: ignore[list-item]


# --- protect -------------------------------------------------------------------------------------

A = tree(proc(10, comm="bash", cmdline=("/bin/bash", "run.sh")),
         proc(11, 10, comm="python3", cmdline=("/usr/bin/python3", "train.py")))
B = tree(proc(20, comm="java", cmdline=("/usr/bin/java", "-jar", "server.jar")))
C = tree(proc(30, comm="postgres", cmdline=("postgres", "-D", "/var/lib/pg")),
         proc(31, 30, comm="postgres", cmdline=("postgres: checkpointer",)))
D = tree(proc(40, comm="kworker", cmdline=()))  # no command line: shown as "[kworker]"
RANKED = [A, B, C, D]


@pytest.mark.parametrize(
    ("protect", "expected"),
    [
        ((), [10, 20, 30, 40]),
        (("nomatch",), [10, 20, 30, 40]),
        (("^java$",), [10, 30, 40]),  # the root, by comm
        (("python3",), [20, 30, 40]),  # a child, by comm
        (("train\\.py",), [20, 30, 40]),  # a child, by command line only
        (("server\\.jar",), [10, 30, 40]),  # the root, by command line only
        (("checkpointer",), [10, 20, 40]),  # a child, by command line
        (("/var/lib/pg",), [10, 20, 40]),
        ((r"^\[kworker\]$",), [10, 20, 30]),  # an empty command line matches as [comm]
        (("java", "postgres"), [10, 40]),
        (("",), []),  # the empty pattern matches everything
    ],
)
def test_protect_drops_any_tree_containing_a_match(protect: tuple[str, ...],
                                                    expected: list[int]) -> None:
    assert roots(apply_preferences(RANKED, prefs(protect=protect))) == expected


def test_protect_matches_anywhere_in_comm_and_command() -> None:
    # re.search, not re.match: a fragment in the middle counts
    assert roots(apply_preferences(RANKED, prefs(protect=("ytho",)))) == [20, 30, 40]


# --- prefer / avoid ------------------------------------------------------------------------------

P1 = tree(proc(1, comm="alpha"))
P2 = tree(proc(2, comm="beta"))
P3 = tree(proc(3, comm="gamma"))
P4 = tree(proc(4, comm="delta"))
P5 = tree(proc(5, comm="epsilon"))
ORDERED = [P1, P2, P3, P4, P5]


@pytest.mark.parametrize(
    ("prefer", "avoid", "expected"),
    [
        ((), (), [1, 2, 3, 4, 5]),
        (("gamma",), (), [3, 1, 2, 4, 5]),
        (("^(delta|beta)$",), (), [2, 4, 1, 3, 5]),  # the given order inside the band
        ((), ("alpha",), [2, 3, 4, 5, 1]),
        ((), ("alpha", "gamma"), [2, 4, 5, 1, 3]),
        (("epsilon",), ("alpha",), [5, 2, 3, 4, 1]),
        (("epsilon", "beta"), ("alpha", "delta"), [2, 5, 3, 1, 4]),
        # a tree matching both counts as preferred
        (("gamma",), ("gamma",), [3, 1, 2, 4, 5]),
        (("a$",), ("^(alpha|beta)$",), [1, 2, 3, 4, 5]),  # alpha, beta, gamma, delta end in a
        (("a$",), ("n$",), [1, 2, 3, 4, 5]),
        (("nomatch",), ("nomatch",), [1, 2, 3, 4, 5]),
    ],
)
def test_prefer_front_avoid_back_stable(prefer: tuple[str, ...], avoid: tuple[str, ...],
                                        expected: list[int]) -> None:
    assert roots(apply_preferences(ORDERED, prefs(prefer=prefer, avoid=avoid))) == expected


def test_prefer_and_avoid_match_command_line() -> None:
    assert roots(apply_preferences(RANKED, prefs(prefer=("server\\.jar",)))) == [20, 10, 30, 40]
    assert roots(apply_preferences(RANKED, prefs(avoid=("/bin/bash",)))) == [20, 30, 40, 10]


def test_prefer_and_avoid_look_at_the_tree_root() -> None:
    # python3 is only a child of tree A: the band is decided by the root (bash run.sh)
    assert roots(apply_preferences(RANKED, prefs(prefer=("python3",)))) == [10, 20, 30, 40]
    assert roots(apply_preferences(RANKED, prefs(avoid=("python3",)))) == [10, 20, 30, 40]


def test_protect_applies_before_ordering() -> None:
    result = apply_preferences(RANKED, prefs(protect=("java",), prefer=("kworker",),
                                             avoid=("bash",)))
    assert roots(result) == [40, 30, 10]


def test_apply_preferences_returns_a_new_list() -> None:
    given = list(ORDERED)
    result = apply_preferences(given, prefs(prefer=("delta",)))
    assert given == ORDERED  # the input is left alone
    assert result is not given
    assert apply_preferences([], prefs(prefer=("x",), protect=("y",), leaders=True)) == []


# --- session leaders -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("root", "leaders", "kept"),
    [
        (proc(100, session=100), True, False),  # a session leader (login shell, session manager)
        (proc(100, session=100, nspid=(100, 7)), True, False),  # a leader in a nested namespace
        (proc(100, session=50), True, True),  # not a session leader
        (proc(100, session=100, nspid=(100, 1)), True, True),  # PID-namespace init: oomguard exec
        (proc(100, session=100, nspid=(100, 40, 1)), True, True),
        (proc(100, session=100), False, True),  # protection off
    ],
)
def test_protect_session_leaders(root: ProcessInfo, leaders: bool, kept: bool) -> None:
    t = tree(root, proc(101, 100, session=root.session))
    result = apply_preferences([t, P2], prefs(leaders=leaders))
    assert roots(result) == ([100, 2] if kept else [2])


@pytest.mark.parametrize(
    ("process", "preferences", "excluded"),
    [
        (proc(7, comm="sshd"), prefs(protect=("sshd",)), True),
        (proc(7, comm="sshd"), prefs(prefer=("sshd",), avoid=("sshd",)), False),
        (proc(7, session=7), prefs(leaders=True), True),
        (proc(7, session=7), prefs(), False),
        (proc(7, session=3), prefs(leaders=True), False),
        (proc(7, session=7, nspid=(7, 1)), prefs(leaders=True), False),
    ],
)
def test_is_excluded(process: ProcessInfo, preferences: Preferences, excluded: bool) -> None:
    assert is_excluded(process, preferences) is excluded


# --- select_victims: the one victim order -------------------------------------------------------

def test_select_victims_counts_gpu_memory_then_applies_the_rules_preferences() -> None:
    from oomguard.policy.preferences import select_victims
    from tests.unit._support import proc_info

    big = tree(proc_info(10, rss_mib=300, comm="big"))
    gpu_job = tree(proc_info(20, rss_mib=100, comm="trainer"))
    editor = tree(proc_info(30, rss_mib=50, comm="vim"))
    vram = {20: 1 << 30}  # 1 GiB of VRAM: the largest footprint
    assert roots(select_victims([big, gpu_job, editor], vram)) == [20, 10, 30]
    assert roots(select_victims([big, gpu_job, editor], {})) == [10, 20, 30]
    rule = prefs(prefer=("vim",), protect=("trainer",))
    assert roots(select_victims([big, gpu_job, editor], vram, rule)) == [30, 10]
    assert select_victims([big, gpu_job, editor], vram)[0].vram_bytes == 1 << 30
