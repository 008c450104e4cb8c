"""Process sensor: /proc parsed into frozen dataclasses.

Parsers take text (tested on real kernel lines and hostile names); `ProcReader` is the thin layer
that reads files under an injectable /proc root.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from oomguard.model.errors import ProcessGone

PF_KTHREAD = 0x00200000  # include/linux/sched.h
PF_EXITING = 0x00000004  # set as a task begins to exit
# SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU as bits of SigPnd/ShdPnd (bit n-1 is signal n). A stop
# signal sent to a task that is already stopped stays pending there until a SIGCONT discards it.
STOP_SIGNALS_MASK = sum(1 << (int(sig) - 1) for sig in (
    signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU))


@dataclass(frozen=True)
class StatFields:
    """The fields of /proc/PID/stat that oomguard uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    tty_nr: int  # the controlling terminal's device number, 0 if none
    flags: int
    starttime: int  # clock ticks since boot: with pid, identifies a process across PID reuse


@dataclass(frozen=True)
class StatusFields:
    """The fields of /proc/PID/status that oomguard uses."""

    uid: int
    rss_bytes: int
    nspid: tuple[int, ...]  # PID in each nested PID namespace, outermost first
    tracer_pid: int = 0  # a ptrace tracer (CRIU while it dumps), 0 if none
    uids: tuple[int, ...] = ()  # real, effective, saved set and file system uid
    pending_signals: int = 0  # SigPnd | ShdPnd: signals queued to the thread or its group

    @property
    def stop_pending(self) -> bool:
        """A stop signal waits: sent while the task was already stopped."""
        return bool(self.pending_signals & STOP_SIGNALS_MASK)


@dataclass(frozen=True)
class ThreadWait:
    """Where one thread is: its state letter and the kernel function it sleeps in (its wchan,
    "" while it runs), e.g. do_freezer_trap for a thread parked by the v2 freezer."""

    tid: int
    state: str
    wchan: str


def threads_told(proc: ProcReader, pids: Iterable[int], wanted: Callable[[ThreadWait], bool],
                 most: int = 16) -> list[dict[str, object]]:
    """The threads of these tasks that `wanted` picks, as an event tells them ({"pid",
    "tid", "state", "wchan"} each), at most `most`; tasks gone meanwhile are left out."""
    found: list[dict[str, object]] = []
    for pid in pids:
        with contextlib.suppress(ProcessGone, OSError):
            found += [{"pid": pid, "tid": wait.tid, "state": wait.state, "wchan": wait.wchan}
                      for wait in proc.thread_waits(pid) if wanted(wait)]
        if len(found) >= most:
            break
    return found[:most]


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    comm: str
    state: str
    uid: int
    rss_bytes: int
    starttime: int
    session: int
    cmdline: tuple[str, ...]
    kernel_thread: bool
    nspid: tuple[int, ...]
    oom_score_adj: int = 0
    tracer_pid: int = 0
    uids: tuple[int, ...] = ()  # real, effective, saved set, file system (empty: unknown)
    pgrp: int = 0  # process group (0: unknown)
    tty_nr: int = 0  # controlling terminal's device number, 0 if none (or unknown)

    @property
    def is_pidns_init(self) -> bool:
        """PID 1 of a nested PID namespace (what `oomguard exec` starts)."""
        return len(self.nspid) > 1 and self.nspid[-1] == 1

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else f"[{self.comm}]"


def parse_stat(text: str) -> StatFields:
    """Parse /proc/PID/stat. The comm field may hold spaces and parentheses: split on the last ')'."""
    try:
        head, _, tail = text.rpartition(")")
        pid_text, _, comm = head.partition(" (")
        fields = tail.split()
        return StatFields(
            pid=int(pid_text),
            comm=comm,
            state=fields[0],
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            session=int(fields[3]),
            tty_nr=int(fields[4]),
            flags=int(fields[6]),
            starttime=int(fields[19]),
        )
    except (IndexError, ValueError) as exc:
        raise ValueError(f"malformed /proc/PID/stat line: {text[:120]!r}") from exc


def parse_status(text: str) -> StatusFields:
    """Parse /proc/PID/status (VmRSS is absent for kernel threads and zombies: 0)."""
    uid = -1
    uids: tuple[int, ...] = ()
    rss_kib = 0
    tracer = 0
    nspid: tuple[int, ...] = ()
    pending = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Uid":
            uids = tuple(int(v) for v in value.split())
            uid = uids[0]
        elif key == "VmRSS":
            rss_kib = int(value.split()[0])
        elif key == "NSpid":
            nspid = tuple(int(v) for v in value.split())
        elif key == "TracerPid":
            tracer = int(value.split()[0])
        elif key in ("SigPnd", "ShdPnd"):
            pending |= int(value.strip(), 16)
    if uid < 0:
        raise ValueError("malformed /proc/PID/status: no Uid line")
    return StatusFields(uid=uid, rss_bytes=rss_kib * 1024, nspid=nspid, tracer_pid=tracer,
                        uids=uids, pending_signals=pending)


def parse_cmdline(raw: bytes) -> tuple[str, ...]:
    """NUL-separated argv; any bytes (newlines, invalid UTF-8) survive as escaped text."""
    if not raw:
        return ()
    return tuple(arg.decode("utf-8", "backslashreplace") for arg in raw.rstrip(b"\0").split(b"\0"))


class ProcReader:
    """Reads processes from a /proc tree (root injectable for tests)."""

    def __init__(self, proc_root: Path | str = "/proc") -> None:
        self.root = Path(proc_root)

    def process(self, pid: int) -> ProcessInfo:
        base = self.root / str(pid)
        try:
            stat = parse_stat((base / "stat").read_text(errors="backslashreplace"))
            status = parse_status((base / "status").read_text(errors="backslashreplace"))
            cmdline = parse_cmdline((base / "cmdline").read_bytes())
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"process {pid} is gone") from exc
        oom_score_adj = 0
        with contextlib.suppress(OSError, ValueError):
            oom_score_adj = int((base / "oom_score_adj").read_text().strip())
        return ProcessInfo(
            pid=stat.pid,
            ppid=stat.ppid,
            comm=stat.comm,
            state=stat.state,
            uid=status.uid,
            rss_bytes=status.rss_bytes,
            starttime=stat.starttime,
            session=stat.session,
            cmdline=cmdline,
            kernel_thread=bool(stat.flags & PF_KTHREAD),
            nspid=status.nspid or (stat.pid,),
            oom_score_adj=oom_score_adj,
            tracer_pid=status.tracer_pid,
            uids=status.uids or (status.uid,),
            pgrp=stat.pgrp,
            tty_nr=stat.tty_nr,
        )

    def processes(self, pids: list[int]) -> list[ProcessInfo]:
        """Those of `pids` that still exist (vanishing ones are routine and skipped)."""
        found = []
        for pid in pids:
            try:
                found.append(self.process(pid))
            except ProcessGone:
                continue
        return found

    def stat(self, pid: int) -> StatFields:
        try:
            return parse_stat((self.root / str(pid) / "stat").read_text(errors="replace"))
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"process {pid} is gone") from exc

    def state(self, pid: int) -> str:
        try:
            return parse_stat((self.root / str(pid) / "stat").read_text(errors="replace")).state
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"process {pid} is gone") from exc

    def thread_states(self, pid: int) -> list[str]:
        """The state of each thread of `pid` (/proc/PID/task/*/stat): a process has stopped
        only once every thread has. Threads that end meanwhile are left out."""
        return [state for _tid, state, _task in self._threads(pid)]

    def thread_waits(self, pid: int) -> list[ThreadWait]:
        """Each thread of `pid` with its state and wchan; threads that end meanwhile are left
        out."""
        waits = []
        for tid, state, task in self._threads(pid):
            try:
                wchan = (task / "wchan").read_text(errors="replace").strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            waits.append(ThreadWait(tid, state, "" if wchan == "0" else wchan))
        return waits

    def _threads(self, pid: int) -> Iterator[tuple[int, str, Path]]:
        """(tid, state, its /proc directory) of each thread still there; ProcessGone where
        the process is."""
        base = self.root / str(pid) / "task"
        try:
            tids = os.listdir(base)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"process {pid} is gone") from exc
        for tid in tids:
            try:
                state = parse_stat((base / tid / "stat").read_text(errors="replace")).state
            except (FileNotFoundError, ProcessLookupError):
                continue
            yield int(tid), state, base / tid

    def status(self, pid: int) -> StatusFields:
        try:
            return parse_status((self.root / str(pid) / "status").read_text(errors="replace"))
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"process {pid} is gone") from exc

    def starttime(self, pid: int) -> int:
        """When `pid` started (clock ticks since boot), 0 if it is gone: with the pid, names one
        process (pids are reused). One read of /proc/PID/stat."""
        try:
            return parse_stat((self.root / str(pid) / "stat").read_text(errors="replace")).starttime
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            return 0

    def ppid(self, pid: int) -> int:
        try:
            return parse_stat((self.root / str(pid) / "stat").read_text(errors="replace")).ppid
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(f"process {pid} is gone") from exc

    def descended_from(self, root: int, processes: Iterable[ProcessInfo],
                       max_depth: int = 256) -> frozenset[int]:
        """Those of `processes` that are `root` or descend from it, found by walking each one's
        parent chain: the cost grows with the candidates, not with root's threads (a daemon
        with thousands of connection threads would make descendants(root) slow). A chain ends
        at the first process that started before `root`: it cannot descend from it."""
        members = list(processes)
        root_start = self.starttime(root)
        parent = {p.pid: p.ppid for p in members}
        started = {p.pid: p.starttime for p in members}
        known: dict[int, bool] = {root: True, 0: False, 1: False, 2: False}

        def reaches(pid: int) -> bool:
            chain, current = [], pid
            for _ in range(max_depth):
                if current in known:
                    break
                if current not in parent:
                    try:
                        stat = parse_stat((self.root / str(current) / "stat").read_text(
                            errors="replace"))
                        parent[current], started[current] = stat.ppid, stat.starttime
                    except (OSError, ValueError):
                        parent[current], started[current] = 0, 0
                if root_start and 0 < started[current] < root_start:
                    known[current] = False
                    break
                chain.append(current)
                current = parent[current]
            verdict = known.get(current, False)
            for pid_on_way in chain:
                known[pid_on_way] = verdict
            return verdict

        return frozenset(p.pid for p in members if reaches(p.pid))

    def all_pids(self) -> list[int]:
        return sorted(int(name) for name in os.listdir(self.root) if name.isdigit())

    def using(self, path: Path) -> list[int]:
        """The processes that have `path` open, or name it in their command line (a writer
        between its start and its open: `podman checkpoint --export PATH` dumps for a while
        before it writes there)."""
        wanted, named = str(path), os.fsencode(path)
        found = []
        for pid in self.all_pids():
            base = self.root / str(pid)
            with contextlib.suppress(OSError):
                if named in (base / "cmdline").read_bytes().split(b"\0"):
                    found.append(pid)
                    continue
                for fd in os.listdir(base / "fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(base / "fd" / fd) == wanted:
                            found.append(pid)
                            break
        return found

    def exists(self, pid: int) -> bool:
        return (self.root / str(pid)).exists()

    def children_of(self, pid: int) -> list[int]:
        """Direct children (all threads' children), from /proc/PID/task/*/children."""
        kids: list[int] = []
        try:
            for task in os.listdir(self.root / str(pid) / "task"):
                try:
                    text = (self.root / str(pid) / "task" / task / "children").read_text()
                except FileNotFoundError:
                    continue
                kids.extend(int(k) for k in text.split())
        except FileNotFoundError:
            return []
        return kids

    def descendants(self, pid: int) -> list[int]:
        """pid and all its descendants, parents before children."""
        order = [pid]
        index = 0
        while index < len(order):
            order.extend(k for k in self.children_of(order[index]) if k not in order)
            index += 1
        return order

    def memory_cgroup(self, pid: int) -> str | None:
        """The v1 memory cgroup path (or the v2 path when there is no v1 memory line)."""
        try:
            text = (self.root / str(pid) / "cgroup").read_text()
        except FileNotFoundError as exc:
            raise ProcessGone(f"process {pid} is gone") from exc
        return parse_memory_cgroup(text)


def parse_memory_cgroup(text: str) -> str | None:
    """From /proc/PID/cgroup: the v1 `memory` hierarchy's path, else the v2 ('0::') path."""
    unified = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier_id, controllers, path = parts
        if "memory" in controllers.split(","):
            return path
        if hier_id == "0" and controllers == "":
            unified = path
    return unified
