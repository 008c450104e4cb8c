"""The page-out's parts that need no kernel: /proc/PID/maps and /proc/swaps read, the ranges
chosen, a partial process_madvise answer carried on, and a swap file's making undone when
one of its steps fails (issue 29). The real page-out of a real process: tests/integration/
test_pageout_real.py."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from oomguard.act.pageout import PageoutError, _after, pageout_ranges, parse_maps
from oomguard.act.swapfiles import MIN_SIZE, PREFIX, SwapFiles
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.model.runner import CommandResult
from oomguard.sense.swaps import SwapReader, parse_swaps

MAPS = """\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1311  /usr/bin/python3.11
55d0c0c21000-55d0c0c42000 rw-p 00021000 fd:01 1311  /usr/bin/python3.11
55d0c1e00000-55d0c2000000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0010000000 rw-p 00000000 00:00 0
7f0010000000-7f0010100000 rw-s 00000000 00:01 77   /dev/shm/shared file (deleted)
7f0020000000-7f0020001000 r--p 00000000 fd:01 99   /tmp/a name with ) spaces
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00100000-7ffd00104000 r--p 00000000 00:00 0                          [vvar]
7ffd00104000-7ffd00106000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
not a maps line
7f0030000000-7f0030000000 rw-p 00000000 00:00 0
"""


def test_maps_are_read_with_names_that_hold_anything() -> None:
    maps = parse_maps(MAPS)
    assert len(maps) == 10  # the malformed line and the empty range are passed over
    assert maps[3].name == "" and maps[3].length == 0x10000000
    assert maps[4].name == "/dev/shm/shared file (deleted)"
    assert maps[5].name == "/tmp/a name with ) spaces"


def test_only_private_mappings_that_are_the_process_own_are_paged_out() -> None:
    chosen = [m.name for m in pageout_ranges(parse_maps(MAPS))]
    assert chosen == ["/usr/bin/python3.11", "/usr/bin/python3.11", "[heap]", "",
                      "/tmp/a name with ) spaces", "[stack]"]  # not shared, vvar, vdso...


def test_a_partial_answer_goes_on_from_where_the_kernel_stopped() -> None:
    pending = [(0x1000, 0x3000), (0x10000, 0x2000), (0x20000, 0x1000)]
    assert _after(pending, 0) == pending
    assert _after(pending, 0x1000) == [(0x2000, 0x2000), (0x10000, 0x2000), (0x20000, 0x1000)]
    assert _after(pending, 0x3000) == [(0x10000, 0x2000), (0x20000, 0x1000)]
    assert _after(pending, 0x4000) == [(0x11000, 0x1000), (0x20000, 0x1000)]
    assert _after(pending, 0x6000) == []


SWAPS = """\
Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority
/dev/zram0                              partition\t4194300\t\t1024\t\t100
/var/lib/oomguard/.swap/oomguard-swap-1\\040x file\t\t65532\t\t65532\t\t-2
garbage line
"""


def test_swap_areas_are_read_in_bytes_with_escaped_names() -> None:
    areas = parse_swaps(SWAPS)
    assert [a.path for a in areas] == ["/dev/zram0", "/var/lib/oomguard/.swap/oomguard-swap-1 x"]
    assert areas[0].size == 4194300 * 1024 and areas[0].free == (4194300 - 1024) * 1024
    assert areas[1].free == 0 and areas[1].priority == -2


def test_no_swap_support_reads_as_no_room(tmp_path: Path) -> None:
    assert SwapReader(tmp_path / "absent").free() == 0


class Runner:
    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = ()) -> CommandResult:
        self.calls.append(list(argv))
        if argv[0] == self.fail:
            return CommandResult(tuple(argv), 255, "", f"{argv[0]}: {argv[1]}: Invalid argument")
        return CommandResult(tuple(argv), 0, "", "")


def test_a_swap_file_is_root_only_allocated_and_switched_on(tmp_path: Path) -> None:
    runner = Runner()
    files = SwapFiles(tmp_path / ".swap", runner, SwapReader(tmp_path / "swaps"),
                      wall_clock=lambda: 1.5)
    path = files.make(40 << 20)
    assert path.name == f"{PREFIX}1500-0"
    assert os.stat(path).st_size == 41 << 20  # whole MiB plus the header's
    assert os.stat(path).st_blocks * 512 >= 41 << 20  # allocated, no holes
    assert (os.stat(path).st_mode & 0o777, os.stat(path.parent).st_mode & 0o777) == (0o600, 0o700)
    assert runner.calls == [["mkswap", str(path)], ["swapon", str(path)]]
    second = files.make(1)  # the same millisecond: another name; the smallest worth making
    assert second.name == f"{PREFIX}1500-1" and os.stat(second).st_size == MIN_SIZE


@pytest.mark.parametrize("step", ["mkswap", "swapon"])
def test_a_swap_file_that_cannot_be_switched_on_is_not_left_behind(tmp_path: Path,
                                                                    step: str) -> None:
    files = SwapFiles(tmp_path / ".swap", Runner(fail=step), SwapReader(tmp_path / "swaps"))
    with pytest.raises(PageoutError, match=f"{step} .* failed: .*Invalid argument"):
        files.make(20 << 20)
    assert list((tmp_path / ".swap").iterdir()) == []


def _v2(tmp_path: Path, swap_max: str, swap_current: int) -> V2MemoryCgroup:
    cg = tmp_path / "job.scope"
    cg.mkdir()
    (cg / "memory.swap.max").write_text(swap_max + "\n")
    (cg / "memory.swap.current").write_text(f"{swap_current}\n")
    return V2MemoryCgroup(cg, tmp_path)


def test_a_v2_swap_limit_with_too_little_room_is_lifted_for_the_page_out_only(
        tmp_path: Path) -> None:
    """memory.swap.max (MemorySwapMax=) in a fake cgroupfs: the real one is the v2 lane's."""
    cg = _v2(tmp_path, str(100 << 20), 90 << 20)
    undo = cg.lift_swap(50 << 20)
    assert undo is not None
    assert (cg.path / "memory.swap.max").read_text() == str(140 << 20)
    undo()
    assert (cg.path / "memory.swap.max").read_text() == str(100 << 20)


@pytest.mark.parametrize(("swap_max", "current"), [("max", 0), (str(200 << 20), 90 << 20)])
def test_a_v2_swap_limit_with_room_is_left_alone(tmp_path: Path, swap_max: str,
                                                 current: int) -> None:
    cg = _v2(tmp_path, swap_max, current)
    assert cg.lift_swap(50 << 20) is None
    assert (cg.path / "memory.swap.max").read_text().strip() == swap_max
