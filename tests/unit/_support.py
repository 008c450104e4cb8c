"""Shared helpers for the unit tests: fixture paths, kernel-format lines, fake /proc trees."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.sense.procfs import PF_KTHREAD, ProcessInfo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MiB = 1 << 20

# flags of an ordinary user task (PF_RANDOMIZE... as the kernel shows it) and of kthreadd's children
USER_FLAGS = 4194304  # 0x400000 PF_RANDOMIZE
KTHREAD_FLAGS = 69238880  # 0x4208060: includes PF_KTHREAD
assert KTHREAD_FLAGS & PF_KTHREAD and not USER_FLAGS & PF_KTHREAD


def fixture_text(*parts: str) -> str:
    return FIXTURES.joinpath(*parts).read_text()


def stat_line(pid: int, comm: str, state: str = "S", ppid: int = 1, *, pgrp: int | None = None,
              session: int | None = None, flags: int = USER_FLAGS, starttime: int = 987654) -> str:
    """A /proc/PID/stat line with all 52 fields, laid out as fs/proc/array.c writes it."""
    pgrp = pid if pgrp is None else pgrp
    session = pid if session is None else session
    after = [
        state, ppid, pgrp, session, 34816, pgrp, flags,  # state..flags (fields 3-9)
        2500, 0, 0, 0, 12, 3, 0, 0, 20, 0, 1, 0,  # minflt..itrealvalue (10-21)
        starttime, 319840256, 51200, 18446744073709551615,  # starttime, vsize, rss, rsslim (22-25)
        94000000000000, 94000000001000, 140720000000000, 0, 0, 0, 0, 16781312, 134234626,
        1, 0, 0, 17, 3, 0, 0, 0, 0, 0,
        94000000002000, 94000000003000, 94000001000000, 140720000001000, 140720000001100,
        140720000001100, 140720000002000, 0,
    ]
    assert len(after) == 50
    return f"{pid} ({comm}) " + " ".join(str(v) for v in after) + "\n"


def status_text(*, pid: int, ppid: int, uid: int = 1000, rss_kib: int | None = 1024,
                nspid: tuple[int, ...] | None = None, name: str = "task") -> str:
    nspid = (pid,) if nspid is None else nspid
    lines = [
        f"Name:\t{name}", "Umask:\t0022", "State:\tS (sleeping)", f"Tgid:\t{pid}", f"Pid:\t{pid}",
        f"PPid:\t{ppid}", "TracerPid:\t0", f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}",
        f"Gid:\t{uid}\t{uid}\t{uid}\t{uid}", "FDSize:\t64",
        "NStgid:\t" + "\t".join(map(str, nspid)), "NSpid:\t" + "\t".join(map(str, nspid)),
    ]
    if rss_kib is not None:
        lines += ["VmPeak:\t  312400 kB", f"VmRSS:\t{rss_kib:8d} kB", "RssAnon:\t    1000 kB"]
    lines += ["Threads:\t1", "voluntary_ctxt_switches:\t10"]
    return "\n".join(lines) + "\n"


@dataclass
class FakeProc:
    """One process in a fake /proc tree."""

    pid: int
    ppid: int
    comm: str = "task"
    state: str = "S"
    uid: int = 1000
    rss_kib: int | None = 1024
    cmdline: bytes = b""
    nspid: tuple[int, ...] | None = None
    flags: int = USER_FLAGS
    starttime: int = 1000
    children: dict[int, list[int]] = field(default_factory=dict)  # tid -> children
    cgroup: str = "12:memory:/jobs/a\n0::/user.slice\n"


def write_proc(root: Path, p: FakeProc) -> Path:
    base = root / str(p.pid)
    base.mkdir(parents=True)
    (base / "stat").write_text(stat_line(p.pid, p.comm, p.state, p.ppid, flags=p.flags,
                                         starttime=p.starttime))
    (base / "status").write_text(status_text(pid=p.pid, ppid=p.ppid, uid=p.uid, rss_kib=p.rss_kib,
                                             nspid=p.nspid, name=p.comm))
    (base / "cmdline").write_bytes(p.cmdline)
    (base / "cgroup").write_text(p.cgroup)
    tasks = p.children or {p.pid: []}
    for tid, kids in tasks.items():
        task = base / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "children").write_text("".join(f"{k} " for k in kids))
        (task / "stat").write_text(stat_line(tid, p.comm, p.state, p.ppid, flags=p.flags,
                                             starttime=p.starttime))
    return base


def fake_proc_tree(root: Path, procs: list[FakeProc]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for p in procs:
        write_proc(root, p)
    return root


def proc_info(pid: int, ppid: int = 1, rss_mib: float = 1, *, starttime: int = 1000,
              nspid: tuple[int, ...] = (), kernel_thread: bool = False, comm: str | None = None,
              uid: int = 1000) -> ProcessInfo:
    return ProcessInfo(
        pid=pid, ppid=ppid, comm=comm or f"p{pid}", state="S", uid=uid,
        rss_bytes=int(rss_mib * MiB), starttime=starttime, session=pid,
        cmdline=(f"/bin/p{pid}",), kernel_thread=kernel_thread, nspid=nspid or (pid,),
    )


def make_executable(path: Path, text: str = "#!/bin/sh\nexit 0\n", mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


@contextlib.contextmanager
def sleeping_processes(count: int) -> Iterator[list[int]]:
    """`count` real processes that sleep (children of the test, so all siblings), killed and
    reaped afterwards."""
    procs = [subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def task_state(pid: int) -> str:
    """A live process's state letter (/proc/PID/stat), "gone" when it is not there."""
    from oomguard.model.errors import ProcessGone
    from oomguard.sense.procfs import ProcReader

    try:
        return ProcReader().state(pid)
    except ProcessGone:
        return "gone"
