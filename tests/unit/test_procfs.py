"""oomguard.sense.procfs: /proc parsers on real kernel lines, and ProcReader on a fake /proc tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.model.errors import ProcessGone
from oomguard.sense.procfs import ProcReader, parse_cmdline, parse_memory_cgroup, parse_stat, parse_status
from tests.unit._support import (
    KTHREAD_FLAGS,
    FakeProc,
    fake_proc_tree,
    fixture_text,
    stat_line,
    write_proc,
)

# -- parse_stat ----------------------------------------------------------------------------------

# Verbatim lines as a 6.x kernel prints them (52 fields).
SYSTEMD_STAT = (
    "1 (systemd) S 0 1 1 0 -1 4194560 98120 2410771 112 1262 311 248 6021 2093 20 0 1 0 28 "
    "23269376 3251 18446744073709551615 1 1 0 0 0 0 671173123 4096 1260 0 0 0 17 2 0 0 0 0 0 "
    "0 0 0 0 0 0 0 0\n"
)
KTHREADD_STAT = (
    "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 2 0 0 20 0 1 0 28 0 0 18446744073709551615 0 "
    "0 0 0 0 0 0 2147483647 0 0 0 0 17 5 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
)
KWORKER_STAT = (
    "187 (kworker/3:1-events) I 2 0 0 0 -1 69238880 0 0 0 0 0 41 0 0 20 0 1 0 412 0 0 "
    "18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
)
ZOMBIE_STAT = (
    "4300 (sh) Z 4242 4242 4100 34816 4242 4227084 97 0 0 0 0 0 0 0 20 0 1 0 991000 0 0 "
    "18446744073709551615 0 0 0 0 0 0 0 0 65536 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 17\n"
)


@pytest.mark.parametrize(
    ("line", "pid", "comm", "state", "ppid", "pgrp", "session", "flags", "starttime"),
    [
        (SYSTEMD_STAT, 1, "systemd", "S", 0, 1, 1, 4194560, 28),
        (KTHREADD_STAT, 2, "kthreadd", "S", 0, 0, 0, 2129984, 28),
        (KWORKER_STAT, 187, "kworker/3:1-events", "I", 2, 0, 0, 69238880, 412),
        (ZOMBIE_STAT, 4300, "sh", "Z", 4242, 4242, 4100, 4227084, 991000),
        (stat_line(4242, "python3", "R", 4100, session=4100, starttime=5), 4242, "python3", "R",
         4100, 4242, 4100, 4194304, 5),
    ],
    ids=["systemd", "kthreadd", "kworker", "zombie", "generated"],
)
def test_parse_stat_real_lines(line: str, pid: int, comm: str, state: str, ppid: int, pgrp: int,
                               session: int, flags: int, starttime: int) -> None:
    st = parse_stat(line)
    assert (st.pid, st.comm, st.state, st.ppid, st.pgrp, st.session, st.flags, st.starttime) == (
        pid, comm, state, ppid, pgrp, session, flags, starttime)


@pytest.mark.parametrize(
    "comm",
    [
        "foo) Z 1 (",  # tries to forge the state and ppid fields
        "a b c",
        "(((",
        ")))",
        ") (",
        "x)",
        "line\nbreak",
        "",
        " ",
        "tab\there",
        "Web Content",
        "15 chars max!!!",
        "1 2 3 4 5 6 7 8",
    ],
    ids=repr,
)
def test_parse_stat_hostile_comm(comm: str) -> None:
    st = parse_stat(stat_line(777, comm, "D", 42, pgrp=40, session=30, starttime=123456))
    assert st.comm == comm
    assert (st.pid, st.state, st.ppid, st.pgrp, st.session, st.starttime) == (
        777, "D", 42, 40, 30, 123456)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "\n",
        "garbage",
        "1 (init)",  # no fields after comm
        "1 (init) S",  # truncated
        "1 (init) S 0 1 1 0 -1 4194560",  # truncated before starttime
        "x (init) S " + " ".join(["0"] * 49),  # pid not a number
        "1 (init) S notanumber " + " ".join(["0"] * 48),  # ppid not a number
    ],
    ids=repr,
)
def test_parse_stat_malformed(line: str) -> None:
    with pytest.raises(ValueError, match="malformed /proc/PID/stat"):
        parse_stat(line)


# -- parse_status --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("fixture", "uid", "rss_bytes", "nspid"),
    [
        ("status.user", 1000, 204800 * 1024, (4242,)),
        ("status.kthread", 0, 0, (187,)),  # kernel threads have no Vm* lines
        ("status.zombie", 1000, 0, (4300,)),  # neither do zombies
        ("status.pidns_init", 0, 65536 * 1024, (5001, 1)),
        ("status.nested_child", 0, 1024 * 1024, (5003, 7, 2)),
    ],
)
def test_parse_status_fixtures(fixture: str, uid: int, rss_bytes: int, nspid: tuple[int, ...]) -> None:
    st = parse_status(fixture_text("proc", fixture))
    assert (st.uid, st.rss_bytes, st.nspid) == (uid, rss_bytes, nspid)


def test_parse_status_uid_is_real_uid_not_effective() -> None:
    # Uid: real, effective, saved, filesystem
    st = parse_status("Name:\tsu\nUid:\t1000\t0\t0\t0\nVmRSS:\t 4 kB\n")
    assert st.uid == 1000
    assert st.rss_bytes == 4096


def test_parse_status_without_nspid_line() -> None:
    # Kernels before 4.1 have no NSpid line.
    assert parse_status("Uid:\t0\t0\t0\t0\n").nspid == ()


@pytest.mark.parametrize(
    ("sigpnd", "shdpnd", "stop_pending"),
    [
        ("0000000000000000", "0000000000000000", False),
        ("0000000000000000", "0000000000040000", True),  # SIGSTOP to the group (kill(2))
        ("0000000000080000", "0000000000000000", True),  # SIGTSTP to the thread
        ("0000000000000000", "0000000000020000", False),  # SIGCHLD only
        ("0000000000000000", "0000000000000100", False),  # SIGKILL: not a stop signal
    ],
)
def test_parse_status_pending_stop(sigpnd: str, shdpnd: str, stop_pending: bool) -> None:
    # As a 6.x kernel prints them, after "SigQ:".
    st = parse_status(f"Uid:\t0\t0\t0\t0\nSigQ:\t0/31334\nSigPnd:\t{sigpnd}\n"
                      f"ShdPnd:\t{shdpnd}\nSigBlk:\t0000000000000000\n")
    assert st.stop_pending is stop_pending


def test_parse_status_fixture_has_nothing_pending() -> None:
    assert parse_status(fixture_text("proc", "status.user")).pending_signals == 0


@pytest.mark.parametrize("text", ["", "Name:\tx\nVmRSS:\t 4 kB\n"], ids=["empty", "no-uid"])
def test_parse_status_without_uid_is_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="no Uid line"):
        parse_status(text)


# -- parse_cmdline -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", ()),
        (b"/usr/bin/python3\0-u\0train.py\0", ("/usr/bin/python3", "-u", "train.py")),
        (b"/usr/bin/python3\0-u\0train.py", ("/usr/bin/python3", "-u", "train.py")),  # no trailing NUL
        (b"sleep\0" + b"1000\0", ("sleep", "1000")),
        (b"prog\0\0middle\0", ("prog", "", "middle")),  # empty argument in the middle survives
        (b"nginx: worker process", ("nginx: worker process",)),  # setproctitle: one string
        (b"echo\0a b\0", ("echo", "a b")),
        (b"printf\0line1\nline2\0", ("printf", "line1\nline2")),
        (b"cat\0caf\xc3\xa9\0", ("cat", "caf\u00e9")),
        (b"cat\0bad\xff\xfename\0", ("cat", "bad\\xff\\xfename")),  # invalid UTF-8 is escaped
    ],
    ids=["empty", "argv", "no-trailing-nul", "two", "empty-arg", "proctitle", "space",
         "newline", "utf8", "invalid-utf8"],
)
def test_parse_cmdline(raw: bytes, expected: tuple[str, ...]) -> None:
    assert parse_cmdline(raw) == expected


# -- parse_memory_cgroup -------------------------------------------------------------------------

V1_CGROUP = """\
12:pids:/user.slice/user-1000.slice/session-2.scope
11:memory:/jobs/build
10:cpu,cpuacct:/user.slice
9:name=systemd:/user.slice/user-1000.slice/session-2.scope
"""
HYBRID_CGROUP = """\
12:pids:/user.slice
9:memory:/a/b
1:name=systemd:/user.slice/user-1000.slice/session-2.scope
0::/user.slice/user-1000.slice/session-2.scope
"""
HYBRID_V2_FIRST = "0::/unified/path\n4:memory:/a/b\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4:memory:/a/b\n", "/a/b"),
        (V1_CGROUP, "/jobs/build"),
        ("0::/user.slice/x\n", "/user.slice/x"),  # v2 only
        ("0::/\n", "/"),
        (HYBRID_CGROUP, "/a/b"),  # the v1 memory hierarchy wins over the v2 path
        (HYBRID_V2_FIRST, "/a/b"),  # whatever the order
        ("9:name=systemd:/\n", None),  # a named hierarchy is not the memory controller
        ("9:name=systemd:/\n0::/init.scope\n", "/init.scope"),
        ("7:cpu,memory:/shared\n", "/shared"),  # co-mounted controllers
        ("5:memory:/\n", "/"),
        ("4:memory:/odd:name/with:colons\n", "/odd:name/with:colons"),
        ("3:memory_extra:/nope\n", None),  # controller names match exactly
        ("", None),
        ("garbage\n", None),
    ],
    ids=["v1", "v1-full", "v2", "v2-root", "hybrid", "hybrid-v2-first", "named-only",
         "named-plus-v2", "comounted", "v1-root", "colons", "not-memory", "empty", "garbage"],
)
def test_parse_memory_cgroup(text: str, expected: str | None) -> None:
    assert parse_memory_cgroup(text) == expected


# -- ProcReader on a fake /proc ------------------------------------------------------------------

@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    """A tree: 100 -> (101 -> 103, 102 -> 104 -> 105), children spread across threads."""
    return fake_proc_tree(tmp_path / "proc", [
        FakeProc(100, 1, comm="launcher", cmdline=b"/bin/sh\0run.sh\0", rss_kib=2048,
                 children={100: [102], 110: [101]}, starttime=500),
        FakeProc(101, 100, comm="worker a", cmdline=b"python3\0-c\0x\0", rss_kib=4096,
                 children={101: [103]}),
        FakeProc(102, 100, comm="worker) Z 1 (", rss_kib=1, children={102: [104]}),
        FakeProc(103, 101, comm="leaf", state="R"),
        FakeProc(104, 102, comm="mid", children={104: [105]}),
        FakeProc(105, 104, comm="init", nspid=(105, 1), cgroup="0::/user.slice/x\n"),
        FakeProc(187, 2, comm="kworker/3:1-events", flags=KTHREAD_FLAGS, rss_kib=None, uid=0),
    ])


def test_process_reads_all_fields(proc_root: Path) -> None:
    p = ProcReader(proc_root).process(101)
    assert (p.pid, p.ppid, p.comm, p.state, p.uid, p.rss_bytes, p.session) == (
        101, 100, "worker a", "S", 1000, 4096 * 1024, 101)
    assert p.cmdline == ("python3", "-c", "x")
    assert p.command == "python3 -c x"
    assert not p.kernel_thread
    assert p.nspid == (101,)
    assert not p.is_pidns_init


def test_process_hostile_comm_and_kernel_thread(proc_root: Path) -> None:
    reader = ProcReader(proc_root)
    hostile = reader.process(102)
    assert (hostile.comm, hostile.state, hostile.ppid) == ("worker) Z 1 (", "S", 100)
    kthread = reader.process(187)
    assert kthread.kernel_thread
    assert kthread.rss_bytes == 0
    assert kthread.cmdline == ()
    assert kthread.command == "[kworker/3:1-events]"


def test_process_pidns_init(proc_root: Path) -> None:
    p = ProcReader(proc_root).process(105)
    assert p.nspid == (105, 1)
    assert p.is_pidns_init


def test_process_without_nspid_line_falls_back_to_pid(tmp_path: Path) -> None:
    root = fake_proc_tree(tmp_path / "proc", [FakeProc(300, 1)])
    status = root / "300" / "status"
    status.write_text("".join(line for line in status.read_text().splitlines(keepends=True)
                              if not line.startswith("NSpid")))
    p = ProcReader(root).process(300)
    assert p.nspid == (300,)
    assert not p.is_pidns_init


def test_process_gone(proc_root: Path) -> None:
    with pytest.raises(ProcessGone, match="process 999 is gone"):
        ProcReader(proc_root).process(999)


def test_process_half_gone(proc_root: Path) -> None:
    # It exited between reading stat and status.
    (proc_root / "103" / "status").unlink()
    with pytest.raises(ProcessGone):
        ProcReader(proc_root).process(103)


def test_processes_skips_vanished(proc_root: Path) -> None:
    (proc_root / "104" / "cmdline").unlink()
    found = ProcReader(proc_root).processes([103, 999, 101, 104, 100])
    assert [p.pid for p in found] == [103, 101, 100]


def test_descendants_parents_before_children(proc_root: Path) -> None:
    reader = ProcReader(proc_root)
    order = reader.descendants(100)
    assert sorted(order) == [100, 101, 102, 103, 104, 105]
    assert order[0] == 100
    parent_of = {101: 100, 102: 100, 103: 101, 104: 102, 105: 104}
    for child, parent in parent_of.items():
        assert order.index(parent) < order.index(child), (child, order)
    assert reader.descendants(104) == [104, 105]
    assert reader.descendants(103) == [103]


def test_children_of_merges_threads(proc_root: Path) -> None:
    assert sorted(ProcReader(proc_root).children_of(100)) == [101, 102]


def test_descendants_of_missing_pid(proc_root: Path) -> None:
    assert ProcReader(proc_root).descendants(999) == [999]
    assert ProcReader(proc_root).children_of(999) == []


def test_descendants_tolerates_duplicates_and_vanished_task(proc_root: Path) -> None:
    # The same child reported by two threads, and a thread whose children file is gone.
    (proc_root / "100" / "task" / "111").mkdir()
    extra = proc_root / "100" / "task" / "112"
    extra.mkdir()
    (extra / "children").write_text("101 ")
    order = ProcReader(proc_root).descendants(100)
    assert order.count(101) == 1
    assert sorted(order) == [100, 101, 102, 103, 104, 105]


def test_state(proc_root: Path) -> None:
    reader = ProcReader(proc_root)
    assert reader.state(103) == "R"
    assert reader.state(100) == "S"
    with pytest.raises(ProcessGone):
        reader.state(999)


def test_state_after_stop(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    write_proc(root, FakeProc(400, 1, comm="a) R 1 (", state="T"))
    assert ProcReader(root).state(400) == "T"


def test_exists(proc_root: Path) -> None:
    reader = ProcReader(proc_root)
    assert reader.exists(100)
    assert not reader.exists(999)


def test_memory_cgroup(proc_root: Path) -> None:
    reader = ProcReader(proc_root)
    assert reader.memory_cgroup(100) == "/jobs/a"
    assert reader.memory_cgroup(105) == "/user.slice/x"
    with pytest.raises(ProcessGone):
        reader.memory_cgroup(999)


def test_reader_on_real_self() -> None:
    """Smoke test against the real /proc: this very process."""
    me = ProcReader().process(os.getpid())
    assert me.pid == os.getpid()
    assert me.ppid == os.getppid()
    assert me.rss_bytes > 0
    assert not me.kernel_thread


def test_thread_waits_of_real_threads() -> None:
    """Each thread of a real process, with its state and the kernel function it sleeps in."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        deadline = time.monotonic() + 10
        while True:
            waits = ProcReader().thread_waits(child.pid)
            if all(wait.state == "S" and wait.wchan for wait in waits) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert sorted(wait.tid for wait in waits) == sorted(
            int(tid) for tid in os.listdir(f"/proc/{child.pid}/task"))
        assert len(waits) == 2 and child.pid in {wait.tid for wait in waits}
        assert {wait.state for wait in waits} == {"S"}
        assert all(wait.wchan and wait.wchan != "0" for wait in waits), waits
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcessGone):
        ProcReader().thread_waits(child.pid)
