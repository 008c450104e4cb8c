"""What CRIU cannot checkpoint is paged out, not killed (issue 29), with the real daemon, the
real CRIU and the real kernel: a job holding a Unix connection to a server outside its tree
(CRIU refuses it) grows past its cgroup's threshold under a rule with actions =
["checkpoint", "pageout"]. The checkpoint fails; the next step makes oomguard's own swap file
(this machine has no swap), pages the stopped job out and keeps it stopped, its cgroup back
under the threshold. Once its memory fits again (the limit raised) the daemon continues it by
the auto-restore rule; or `oomguard resume PID` does, and a daemon SIGKILLed meanwhile leaves
it stopped and recorded. Either way the job counts on from where it stopped, its memory
intact, and the swap file is gone once nothing needs it.

While the swap file is on, the kernel may swap other processes too: it lives only as long as
the test's job is paged out."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.cgrouphold import HOLD_PREFIX, unified_path
from oomguard.act.swapfiles import SwapFiles
from oomguard.cgroup.base import MemoryCgroup
from oomguard.store.names import PAGED_OUT, SWAP_DIR
from oomguard.store.pagedout import PagedOutRecord
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    close_server,
    kill_pid,
    outside_server,
    proc_state,
    run_oomguard,
    short_socket_path,
    start_in_cgroup,
    wait_until,
)

pytestmark = pytest.mark.integration
LIMIT = 256 * MiB  # the threshold, 85%, is 217 MiB

CHUNKS = Path(__file__).resolve().parents[1] / "workloads" / "chunks.py"


def chunks_job(log: Path, target: int, count: int, link: Path | None = None) -> list[str]:
    """tests/workloads/chunks.py: grows 4 MiB a step to `target` MiB, counting; at `count`
    checks its memory ("done COUNT ok"); with `link`, connected to a Unix server there."""
    return [sys.executable, str(CHUNKS), "--log", str(log), "--target", str(target),
            "--count", str(count), *(["--link", str(link)] if link is not None else [])]


def _counts(log: Path) -> list[int]:
    return [int(ln.split()[0]) for ln in log.read_text().splitlines() if ln[:1].isdigit()] \
        if log.exists() else []


def _swap_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSwap:"):
            return int(line.split()[1])
    return 0


def _config(tmp_path: Path, store: Path, cgroup: Path, socket: Path,
            quiet: str = "1s", at_stop: str = "keep") -> Path:
    config = tmp_path / f"oomguard-{at_stop}.toml"
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{socket}"\n'
                      f'pageout_at_stop = "{at_stop}"\n\n[[guard]]\n'
                      f'cgroups = ["{cgroup}"]\nactions = ["checkpoint", "pageout"]\n'
                      f'restore_quiet = "{quiet}"\n')
    return config


def _remove_swap(store: Path) -> None:
    """oomguard's swap files a failed test left on."""
    for area in SwapFiles(store / SWAP_DIR).ours():
        SwapFiles(store / SWAP_DIR).remove(Path(area.path))


def _end(guard: DaemonProcess, job: subprocess.Popen[bytes] | None, server: socket.socket,
         accepted: list[socket.socket], store: Path) -> None:
    """A test's end, passed or not: the daemon stopped, the job gone, the server closed."""
    guard.stop()
    if job is not None:
        kill_pid(job.pid)
    close_server(server, accepted)
    _remove_swap(store)


def held(pid: int) -> bool:
    """Held by the page-out: stopped (SIGSTOP: cgroup v1, a traced tree), or, on cgroup v2,
    in a frozen cgroup of its own (oomguard.act.cgrouphold)."""
    if proc_state(pid) == "T":
        return True
    where = unified_path(Path(f"/proc/{pid}/cgroup").read_text()) or ""
    if not Path(where).name.startswith(HOLD_PREFIX):
        return False
    events = (Path("/sys/fs/cgroup") / where.lstrip("/") / "cgroup.events").read_text()
    return "frozen 1" in events.splitlines()


def _paged_out(guard: DaemonProcess, job: int, cgroup: MemoryCgroup) -> dict[str, Any]:
    """The job paged out: stopped, its memory in swap, its cgroup under the threshold."""
    failed = guard.wait_event("checkpoint.failed", timeout=60)[0]
    assert "unix" in failed["error"].lower(), failed
    assert failed["then"] == "pageout", failed
    paged = guard.wait_event("victim.paged_out", timeout=60)[0]
    assert paged["pid"] == job and paged["paged_bytes"] >= 200 * MiB, paged
    assert held(job)
    assert paged["held_by"] == ("SIGSTOP" if cgroup.version == 1 else
                                f"cgroup.freeze {cgroup.path}/{HOLD_PREFIX}{paged['paged_out_id']}")
    assert _swap_kib(job) << 10 >= 190 * MiB
    assert cgroup.snapshot().usage_bytes < int(LIMIT * 0.85)  # the swap cache reclaimed too
    return paged


def test_an_undumpable_job_is_paged_out_and_auto_resumed_once_it_fits(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("pageout", LIMIT)
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    log = tmp_path / "job.log"
    socket = short_socket_path()
    job = None
    try:
        guard = DaemonProcess(store, tmp_path / "daemon.log",
                              config=_config(tmp_path, store, cg.path, socket), socket=socket)
        try:
            guard.wait_event("guard.ready")
            job = start_in_cgroup(cg, chunks_job(log, 232, 400, peer))
            paged = _paged_out(guard, job.pid, cg)
            swap_files = paged["swap_files"]
            assert isinstance(swap_files, list) and len(swap_files) == 1
            assert os.stat(swap_files[0]).st_mode & 0o777 == 0o600
            listed = json.loads(run_oomguard(store, "list", "--json").stdout)
            assert [e["state"] for e in listed if e["pid"] == job.pid] == ["paged-out"]
            stopped_at = _counts(log)[-1]
            time.sleep(1.5)  # stays stopped: its memory does not fit yet
            assert _counts(log)[-1] == stopped_at and held(job.pid)

            cg.set_limit(2 * LIMIT)  # room again: 232 MiB + the margin fits under 435 MiB
            resumed = guard.wait_event("pageout.resumed", timeout=60)[0]
            assert resumed["auto"] is True and resumed["continued"] == [job.pid], resumed
            assert wait_until(lambda: "done 400" in log.read_text(), 60), log.read_text()[-200:]
            assert "done 400 ok" in log.read_text()
            counts = _counts(log)
            assert counts == list(range(1, 401))  # on from where it stopped, none lost
            assert job.wait(10) == 0
            assert not (store / PAGED_OUT).exists()
            assert SwapFiles(store / SWAP_DIR).ours() == []  # switched off, deleted
            assert not Path(swap_files[0]).exists()
            assert not guard.events("victim.killed")
        finally:
            guard.stop()
        assert accepted, "the job never connected to the server outside its tree"
    finally:
        if job is not None:
            kill_pid(job.pid)
        close_server(server, accepted)
        _remove_swap(store)


def test_a_paged_out_job_outlives_a_daemon_kill_and_resumes_on_request(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("resume", LIMIT)
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    log = tmp_path / "job.log"
    socket = short_socket_path()
    config = _config(tmp_path, store, cg.path, socket, quiet="600s")  # no auto-resume here
    job = None
    guard = DaemonProcess(store, tmp_path / "daemon.log", config=config, socket=socket)
    try:
        guard.wait_event("guard.ready")
        job = start_in_cgroup(cg, chunks_job(log, 232, 300, peer))
        paged = _paged_out(guard, job.pid, cg)
        stopped_at = _counts(log)[-1]
        guard.handle.send_signal(signal.SIGKILL)
        guard.handle.wait()
        guard = DaemonProcess(store, tmp_path / "daemon2.log", config=config, socket=socket)
        guard.wait_event("guard.ready")
        time.sleep(2)  # a restart continues nothing that is paged out
        assert held(job.pid) and _counts(log)[-1] == stopped_at
        assert not guard.events("victim.thawed_after_crash")

        cg.set_limit(2 * LIMIT)  # room for it (resumed where it does not fit, it would be
        # paged out again by the next crossing)
        said = run_oomguard(store, "--socket", str(socket), "resume", str(job.pid))
        assert said.returncode == 0, said.stderr
        assert said.stdout.strip() == str(job.pid)
        assert wait_until(lambda: "done 300" in log.read_text(), 60), log.read_text()[-200:]
        assert "done 300 ok" in log.read_text()
        assert _counts(log) == list(range(1, 301))
        assert job.wait(10) == 0
        assert SwapFiles(store / SWAP_DIR).ours() == [] and not (store / PAGED_OUT).exists()
        again = run_oomguard(store, "--socket", str(socket), "resume", str(paged["paged_out_id"]))
        assert again.returncode != 0 and "no paged-out tree" in again.stderr
    finally:
        _end(guard, job, server, accepted, store)


def test_a_clean_stop_keeps_a_paged_out_job_and_says_so_or_resumes_it_as_configured(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """pageout_at_stop: "keep" (the default) leaves the paged-out job stopped and recorded
    across a clean stop, with pageout.kept naming it; "resume" continues it at the stop
    (pageout.resumed, at_stop), and it counts on to its end with its memory intact."""
    cg = cgroups.make("atstop", LIMIT)
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    log = tmp_path / "job.log"
    socket = short_socket_path()
    job = None
    guard = DaemonProcess(store, tmp_path / "daemon.log", socket=socket,
                          config=_config(tmp_path, store, cg.path, socket, quiet="600s"))
    try:
        guard.wait_event("guard.ready")
        job = start_in_cgroup(cg, chunks_job(log, 232, 300, peer))
        paged = _paged_out(guard, job.pid, cg)
        assert guard.stop() == 0
        [kept] = guard.events("pageout.kept")
        assert kept["paged_out"] == [paged["paged_out_id"]]
        assert held(job.pid) and (store / PAGED_OUT).exists()

        cg.set_limit(2 * LIMIT)  # room for it once continued
        guard = DaemonProcess(store, tmp_path / "daemon2.log", socket=socket,
                              config=_config(tmp_path, store, cg.path, socket, quiet="600s",
                                             at_stop="resume"))
        guard.wait_event("guard.ready")
        assert held(job.pid)  # a start continues nothing (restore_quiet: 600 s)
        assert guard.stop() == 0
        [resumed] = guard.events("pageout.resumed")
        assert resumed["at_stop"] is True and resumed["pid"] == job.pid, resumed
        assert not guard.events("pageout.kept")
        assert wait_until(lambda: "done 300" in log.read_text(), 60), log.read_text()[-200:]
        assert "done 300 ok" in log.read_text() and _counts(log) == list(range(1, 301))
        assert job.wait(10) == 0
        assert SwapFiles(store / SWAP_DIR).ours() == [] and not (store / PAGED_OUT).exists()
    finally:
        _end(guard, job, server, accepted, store)


# A real X11 client: a Tk window on the display server outside its tree (CRIU cannot dump that
# connection), growing 4 MiB a step from Tk's own event loop, counting into its log; at COUNT
# it checks every chunk, writes "done COUNT ok" and puts it in its window's title, which it
# closes LINGER seconds later.
TK_COUNTER = r"""
import sys, tkinter
log, target, total = open(sys.argv[1], "a", buffering=1), int(sys.argv[2]), int(sys.argv[3])
root = tkinter.Tk()
label = tkinter.Label(root, text="0")
label.pack()
chunks, count = [], 0
def step():
    global count
    count += 1
    if len(chunks) * 4 < target:
        chunks.append(bytes([len(chunks) % 251]) * (4 << 20))
    label.configure(text=str(count))
    log.write(f"{count} {len(chunks) * 4}\n")
    if count < total:
        root.after(20, step)
    else:
        ok = all(c == bytes([i % 251]) * (4 << 20) for i, c in enumerate(chunks))
        log.write(f"done {total} {'ok' if ok else 'CORRUPT'}\n")
        root.title(f"oomguard-tk done {total} {'ok' if ok else 'CORRUPT'}")
        root.after(int(sys.argv[4]) * 1000, root.destroy)  # the display asked meanwhile
root.after(20, step)
root.mainloop()
"""


def _xvfb(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Xvfb on a free display, outside any job; returns it and its DISPLAY."""
    if shutil.which("Xvfb") is None or shutil.which("xwininfo") is None:
        pytest.skip("Xvfb or xwininfo is not installed (scripts/setup installs xvfb, "
                    "x11-utils)")
    read, write = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-nolisten", "tcp",
                               "-screen", "0", "640x480x24"], pass_fds=(write,),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "xvfb.log", "wb"))  # noqa: SIM115
    os.close(write)
    with os.fdopen(read) as answer:
        number = answer.readline().strip()
    assert number.isdigit(), (tmp_path / "xvfb.log").read_text()
    return server, f":{number}"


def _windows(display: str) -> str:
    """The display's window tree with the windows' names (xwininfo, x11-utils)."""
    return subprocess.run(["xwininfo", "-display", display, "-root", "-tree"],
                          capture_output=True, text=True, timeout=10).stdout


def test_a_tk_window_is_paged_out_not_killed_and_runs_on_with_its_display(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """The issue's own case: the biggest memory user is a program connected to the display
    server, which CRIU cannot dump. It is paged out, then continued once its memory fits,
    and it goes on drawing on the same display connection to its end."""
    server, display = _xvfb(tmp_path)
    cg = cgroups.make("tk", LIMIT)
    log = tmp_path / "tk.log"
    socket = short_socket_path()
    job = None
    guard = DaemonProcess(store, tmp_path / "daemon.log",
                          config=_config(tmp_path, store, cg.path, socket), socket=socket)
    try:
        guard.wait_event("guard.ready")
        job = start_in_cgroup(cg, ["env", f"DISPLAY={display}", sys.executable, "-c",
                                   TK_COUNTER, str(log), "232", "300", "20"],
                              log=tmp_path / "tk.err")
        failed = guard.wait_event("checkpoint.failed", timeout=60)[0]
        assert failed["then"] == "pageout", failed
        _paged_out(guard, job.pid, cg)
        cg.set_limit(2 * LIMIT)
        assert guard.wait_event("pageout.resumed", timeout=60)[0]["continued"] == [job.pid]
        assert wait_until(lambda: "done 300" in log.read_text(), 60), \
            (tmp_path / "tk.err").read_text()[-500:]
        assert "done 300 ok" in log.read_text()
        assert _counts(log) == list(range(1, 301))
        # The display server sees what the client did after it was continued, on the same
        # connection: its window, titled with its result (xwininfo, as a person would ask).
        assert wait_until(lambda: '"oomguard-tk done 300 ok"' in _windows(display), 20), \
            _windows(display)
        assert job.wait(30) == 0, (tmp_path / "tk.err").read_text()[-500:]
        assert SwapFiles(store / SWAP_DIR).ours() == []
    finally:
        guard.stop()
        if job is not None:
            kill_pid(job.pid)
        server.terminate()
        server.wait(10)
        for area in SwapFiles(store / SWAP_DIR).ours():
            SwapFiles(store / SWAP_DIR).remove(Path(area.path))




def test_a_traced_job_is_paged_out_each_time_it_outgrows_its_room(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    """A job under `strace -f` (CRIU cannot dump a traced task: the checkpoint is refused
    before anything is stopped) is paged out, tracer and tracee stopped; continued, it goes
    on under its tracer. Refused for good by the checkpoint step, it is still taken again
    by the page-out when it outgrows its new room, and once more continued to its end."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (scripts/setup installs it)")
    cg = cgroups.make("traced", LIMIT)
    log = tmp_path / "job.log"
    socket = short_socket_path()
    job = None
    guard = DaemonProcess(store, tmp_path / "daemon.log",
                          config=_config(tmp_path, store, cg.path, socket), socket=socket)
    try:
        guard.wait_event("guard.ready")
        job = start_in_cgroup(cg, ["strace", "-f", "-o", "/dev/null",
                                   *chunks_job(log, 400, 400)], log=tmp_path / "job.err")
        refused = guard.wait_event("checkpoint.refused", timeout=60)[0]
        assert "traced" in refused["reason"] and refused["then"] == "pageout", refused
        first = guard.wait_event("victim.paged_out", timeout=60)[0]
        assert first["pid"] == job.pid, first  # the tree: strace and its tracee
        assert first["held_by"] == "SIGSTOP", first  # its tracer holds it: never a cgroup's
        traced = [pid for pid, _ in PagedOutRecord(store).trees()[0].tasks if pid != job.pid]
        assert traced and held(job.pid) and proc_state(traced[0]) == "t"
        assert _swap_kib(traced[0]) << 10 >= 190 * MiB
        assert cg.snapshot().usage_bytes < int(LIMIT * 0.85)

        cg.set_limit(448 * MiB)  # room for now; at 400 MiB it outgrows 85% of 448 MiB again
        assert guard.wait_event("pageout.resumed", timeout=60)[0]["auto"] is True
        second = guard.wait_event("victim.paged_out", timeout=60, count=2)[1]
        assert second["pid"] == job.pid and second["paged_out_id"] != first["paged_out_id"]
        assert proc_state(traced[0]) == "t" and cg.snapshot().usage_bytes < int(448 * MiB * 0.85)

        cg.set_limit(4 * LIMIT)
        guard.wait_event("pageout.resumed", timeout=60, count=2)
        assert wait_until(lambda: "done 400" in log.read_text(), 90), log.read_text()[-200:]
        assert "done 400 ok" in log.read_text()
        assert _counts(log) == list(range(1, 401))  # every step, in order, none lost
        assert job.wait(10) == 0, (tmp_path / "job.err").read_text()[-500:]
        assert SwapFiles(store / SWAP_DIR).ours() == [] and not (store / PAGED_OUT).exists()
        assert not guard.events("victim.killed") and not guard.events("victim.none")
    finally:
        guard.stop()
        if job is not None:
            kill_pid(job.pid)
        for area in SwapFiles(store / SWAP_DIR).ours():
            SwapFiles(store / SWAP_DIR).remove(Path(area.path))
