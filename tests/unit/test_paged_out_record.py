"""The record of paged-out trees and their resume (issue 29), on real processes: a tree is
continued only as the same processes and only where still stopped; one that ended leaves the
record; the swap files of ours that nothing needs are switched off (a fake swapoff, a fake
/proc/swaps: the real ones are tests/integration/test_pageout_*.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from oomguard.act.swapfiles import PREFIX, SwapFiles
from oomguard.lifecycle.pagedresume import Resumer
from oomguard.model.runner import CommandResult
from oomguard.sense.procfs import ProcReader
from oomguard.sense.swaps import SwapReader
from oomguard.store.names import PAGED_OUT
from oomguard.store.pagedout import PagedOutRecord, PagedOutTree


def _state(pid: int) -> str:
    return ProcReader().state(pid)


def _wait_state(pid: int, want: str) -> None:
    deadline = time.monotonic() + 5
    while _state(pid) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(pid) == want


@pytest.fixture
def stopped() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    os.kill(child.pid, signal.SIGSTOP)
    _wait_state(child.pid, "T")
    yield child
    child.kill()
    child.wait()


def _tree(pid: int, swap: tuple[str, ...] = (), tree_id: str = "") -> PagedOutTree:
    return PagedOutTree(id=tree_id or f"po-{pid}-1", root_pid=pid,
                        tasks=((pid, ProcReader().starttime(pid)),), uid=0, cgroup="/x",
                        since=1.0, paged_bytes=100 << 20, resident_bytes=120 << 20,
                        command="sleep", swap_files=swap)


class Swapoff:
    def __init__(self, swaps: Path) -> None:
        self.swaps = swaps
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = ()) -> CommandResult:
        self.calls.append(list(argv))
        lines = [ln for ln in self.swaps.read_text().splitlines() if not ln.startswith(argv[1])]
        self.swaps.write_text("\n".join(lines) + "\n")
        return CommandResult(tuple(argv), 0, "", "")


def _swap_files(tmp_path: Path, names: list[str]) -> tuple[SwapFiles, Swapoff]:
    directory = tmp_path / ".swap"
    directory.mkdir()
    table = tmp_path / "swaps"
    rows = ["Filename Type Size Used Priority", "/dev/zram0 partition 1024 0 100"]
    for name in names:
        (directory / name).write_bytes(b"")
        rows.append(f"{directory / name} file 65532 100 -2")
    table.write_text("\n".join(rows) + "\n")
    runner = Swapoff(table)
    return SwapFiles(directory, runner, SwapReader(table)), runner


def test_the_record_is_root_only_durable_and_found_by_id_or_any_pid(tmp_path: Path) -> None:
    record = PagedOutRecord(tmp_path)
    tree = PagedOutTree(id="po-10-5", root_pid=10, tasks=((10, 7), (11, 8)), uid=1000,
                        cgroup="/a", since=5.0, paged_bytes=1, resident_bytes=2, command="x",
                        swap_files=("/s/1",))
    record.add(tree)
    assert os.stat(tmp_path / PAGED_OUT).st_mode & 0o777 == 0o600
    assert PagedOutRecord(tmp_path).trees() == [tree]  # read back as written
    assert record.find("po-10-5") == tree and record.find("11") == tree
    assert record.find("12") is None and record.swap_in_use() == {"/s/1"}
    record.remove("po-10-5")
    assert record.trees() == [] and not (tmp_path / PAGED_OUT).exists()


def test_a_malformed_record_reads_as_nothing_never_as_a_crash(tmp_path: Path) -> None:
    (tmp_path / PAGED_OUT).write_text('[{"id": "po-1"}, 3, "x"]')
    assert PagedOutRecord(tmp_path).trees() == []
    (tmp_path / PAGED_OUT).write_text("{not json")
    assert PagedOutRecord(tmp_path).trees() == []


def test_resume_continues_the_stopped_tree_and_switches_off_its_swap_file(
        tmp_path: Path, stopped: subprocess.Popen[bytes]) -> None:
    name = f"{PREFIX}1-0"
    swap, runner = _swap_files(tmp_path, [name])
    path = str(tmp_path / ".swap" / name)
    record = PagedOutRecord(tmp_path)
    record.add(_tree(stopped.pid, (path,)))
    done = Resumer(record, swap).resume(record.trees()[0])
    assert done.continued == [stopped.pid] and done.gone == []
    _wait_state(stopped.pid, "S")
    assert record.trees() == []
    assert runner.calls == [["swapoff", path]] and done.swap_removed == [path]
    assert not Path(path).exists() and swap.ours() == []


def test_a_swap_file_another_paged_out_tree_needs_stays_on(
        tmp_path: Path, stopped: subprocess.Popen[bytes]) -> None:
    name = f"{PREFIX}1-0"
    swap, runner = _swap_files(tmp_path, [name])
    path = str(tmp_path / ".swap" / name)
    record = PagedOutRecord(tmp_path)
    record.add(_tree(stopped.pid, (path,)))
    record.add(_tree(os.getpid(), (path,), tree_id="po-other"))  # (never resumed here)
    done = Resumer(record, swap).resume(record.find(str(stopped.pid)) or _tree(0))
    assert done.continued == [stopped.pid] and runner.calls == [] and done.swap_removed == []
    assert [t.id for t in record.trees()] == ["po-other"]


def test_a_reused_pid_is_never_continued(tmp_path: Path,
                                         stopped: subprocess.Popen[bytes]) -> None:
    swap, _ = _swap_files(tmp_path, [])
    record = PagedOutRecord(tmp_path)
    tree = _tree(stopped.pid)
    record.add(PagedOutTree(**{**tree.__dict__, "tasks": ((stopped.pid, 1),)}))  # another start
    done = Resumer(record, swap).resume(record.trees()[0])
    assert done.continued == [] and done.gone == [stopped.pid]
    assert _state(stopped.pid) == "T" and record.trees() == []


def test_a_tree_killed_while_paged_out_leaves_the_record_and_frees_its_swap(
        tmp_path: Path) -> None:
    name = f"{PREFIX}1-0"
    swap, runner = _swap_files(tmp_path, [name])
    path = str(tmp_path / ".swap" / name)
    child = subprocess.Popen(["sleep", "60"])
    record = PagedOutRecord(tmp_path)
    record.add(_tree(child.pid, (path,)))
    resumer = Resumer(record, swap)
    assert resumer.ended() == []  # alive: stays
    child.kill()
    child.wait()
    over = resumer.ended()
    assert [d.tree.root_pid for d in over] == [child.pid] and over[0].continued == []
    assert record.trees() == [] and runner.calls == [["swapoff", path]]


def test_a_tree_held_by_sigstop_that_someone_continues_is_stopped_again(
        tmp_path: Path, stopped: subprocess.Popen[bytes]) -> None:
    """A shell's `fg` or a `kill -CONT` must not run a paged-out tree into memory that is not
    there (cgroup v1, or a tree no frozen cgroup could hold)."""
    swap, _ = _swap_files(tmp_path, [])
    record = PagedOutRecord(tmp_path)
    record.add(_tree(stopped.pid))
    resumer = Resumer(record, swap)
    assert resumer.restop(record.trees()[0]) == []  # still stopped: nothing to do
    os.kill(stopped.pid, signal.SIGCONT)
    _wait_state(stopped.pid, "S")
    assert resumer.restop(record.trees()[0]) == [stopped.pid]
    _wait_state(stopped.pid, "T")
    assert [t.id for t in record.trees()] == [f"po-{stopped.pid}-1"]  # still paged out


class Holds:
    """A CgroupHold's release, recorded (the real one: the v2 lane's page-out tests)."""

    def __init__(self, moved: list[int] | None = None, error: OSError | None = None) -> None:
        self.moved = moved or []
        self.error = error
        self.released: list[Path] = []

    def release(self, child: Path) -> list[int]:
        self.released.append(child)
        if self.error is not None:
            raise self.error
        return self.moved


def test_a_tree_held_by_a_frozen_cgroup_is_released_not_signalled_and_never_restopped(
        tmp_path: Path, stopped: subprocess.Popen[bytes]) -> None:
    swap, _ = _swap_files(tmp_path, [])
    record = PagedOutRecord(tmp_path)
    hold = str(tmp_path / "job" / "oomguard-held-po-1")  # (a directory stands in for it)
    Path(hold).mkdir(parents=True)
    record.add(PagedOutTree(**{**_tree(stopped.pid).__dict__, "hold": hold}))
    assert PagedOutRecord(tmp_path).trees()[0].hold == hold  # kept in the record
    holds = Holds(moved=[stopped.pid])
    resumer = Resumer(record, swap, holds=holds)  # type: ignore[arg-type]
    os.kill(stopped.pid, signal.SIGCONT)  # (as the freezer would hold it: running, held)
    _wait_state(stopped.pid, "S")
    assert resumer.restop(record.trees()[0]) == []  # the kernel holds it, not a SIGSTOP
    os.kill(stopped.pid, signal.SIGSTOP)
    _wait_state(stopped.pid, "T")
    done = resumer.resume(record.trees()[0])
    assert holds.released == [Path(hold)] and done.continued == [stopped.pid]
    assert _state(stopped.pid) == "T"  # released, not SIGCONTed a second time
    assert record.trees() == []


def test_a_frozen_cgroup_that_cannot_be_released_keeps_the_tree_held_and_recorded(
        tmp_path: Path, stopped: subprocess.Popen[bytes]) -> None:
    swap, _ = _swap_files(tmp_path, [])
    record = PagedOutRecord(tmp_path)
    record.add(PagedOutTree(**{**_tree(stopped.pid).__dict__,
                               "hold": "/sys/fs/cgroup/oomguard-held-po-1"}))
    holds = Holds(error=PermissionError(13, "Permission denied"))
    resumer = Resumer(record, swap, holds=holds)  # type: ignore[arg-type]
    done = resumer.resume(record.trees()[0])
    assert "Permission denied" in done.hold_left and done.continued == []
    assert _state(stopped.pid) == "T" and len(record.trees()) == 1


def test_a_record_written_before_holds_existed_reads_as_held_by_sigstop(tmp_path: Path) -> None:
    (tmp_path / PAGED_OUT).write_text(
        '[{"id": "po-1-2", "root_pid": 1, "tasks": [[1, 2]], "uid": 0, "cgroup": "/a", '
        '"since": 1.0, "paged_bytes": 1, "resident_bytes": 2, "command": "x"}]')
    assert [t.hold for t in PagedOutRecord(tmp_path).trees()] == [""]


def test_a_tree_whose_frozen_cgroup_a_crash_kept_from_being_made_is_stopped_again(
        tmp_path: Path, stopped: subprocess.Popen[bytes]) -> None:
    swap, _ = _swap_files(tmp_path, [])
    record = PagedOutRecord(tmp_path)
    hold = str(tmp_path / "job" / "oomguard-held-po-1")  # recorded, never made
    record.add(PagedOutTree(**{**_tree(stopped.pid).__dict__, "hold": hold}))
    os.kill(stopped.pid, signal.SIGCONT)
    _wait_state(stopped.pid, "S")
    assert Resumer(record, swap).restop(record.trees()[0]) == [stopped.pid]
    _wait_state(stopped.pid, "T")
