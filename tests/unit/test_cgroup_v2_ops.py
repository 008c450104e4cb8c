"""oomguard.cgroup.v2 (and v1's raise_limit) writing to fake cgroup directories of plain files."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.model.errors import CgroupGone
from tests.unit._support import MiB

MAX = "max"


def v2_dir(root: Path, *, max_: str = f"{256 * MiB}", high: str = MAX,
           events: str = "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
           cgroup_events: str = "populated 1\nfrozen 0\n") -> V2MemoryCgroup:
    path = root / "jobs"
    path.mkdir(parents=True)
    files = {
        "memory.max": max_ + "\n", "memory.high": high + "\n", "memory.current": f"{200 * MiB}\n",
        "memory.stat": f"anon {150 * MiB}\nfile {40 * MiB}\nkernel 1048576\n",
        "memory.events": events, "cgroup.freeze": "0\n", "cgroup.events": cgroup_events,
        "cgroup.procs": "5001\n",
    }
    for name, text in files.items():
        (path / name).write_text(text)
    return V2MemoryCgroup(path, root)


def read(cg: V2MemoryCgroup | V1MemoryCgroup, name: str) -> str:
    return (cg.path / name).read_text()


# -- memory.high ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("value", "written"),
    [(None, "max"), (200 * MiB, str(200 * MiB)), (0, "0"), (1, "1")],
)
def test_set_high_and_high(tmp_path: Path, value: int | None, written: str) -> None:
    cg = v2_dir(tmp_path, high="12345")
    cg.set_high(value)
    assert read(cg, "memory.high") == written
    assert cg.high() == value


@pytest.mark.parametrize(("text", "value"), [("max\n", None), ("max", None), ("209715200\n", 200 * MiB)])
def test_high_parses(tmp_path: Path, text: str, value: int | None) -> None:
    cg = v2_dir(tmp_path)
    (cg.path / "memory.high").write_text(text)
    assert cg.high() == value


# -- raise_limit ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("max_", "high", "new", "raised", "restored"),
    [
        # (memory.max, memory.high) before; new limit; (max, high) raised; (max, high) after undo
        (f"{256 * MiB}", f"{200 * MiB}", 300 * MiB,
         (300 * MiB, 300 * MiB), (256 * MiB, 200 * MiB)),
        (f"{256 * MiB}", MAX, 300 * MiB,  # 'max' stays 'max': it does not throttle
         (300 * MiB, None), (256 * MiB, None)),
        (f"{256 * MiB}", f"{400 * MiB}", 300 * MiB,  # already above the new limit: left alone
         (300 * MiB, 400 * MiB), (256 * MiB, 400 * MiB)),
        (f"{256 * MiB}", f"{300 * MiB}", 300 * MiB,  # equal: left alone
         (300 * MiB, 300 * MiB), (256 * MiB, 300 * MiB)),
        (MAX, f"{200 * MiB}", 300 * MiB,
         (300 * MiB, 300 * MiB), (None, 200 * MiB)),
    ],
    ids=["high-below", "high-max", "high-above", "high-equal", "max-unlimited"],
)
def test_raise_limit_and_undo(tmp_path: Path, max_: str, high: str, new: int,
                              raised: tuple[int | None, int | None],
                              restored: tuple[int | None, int | None]) -> None:
    cg = v2_dir(tmp_path, max_=max_, high=high)
    undo = cg.raise_limit(new)
    assert (cg.limit(), cg.high()) == raised
    undo()
    assert (cg.limit(), cg.high()) == restored


def test_raise_limit_file_contents(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path, max_=f"{256 * MiB}", high=f"{200 * MiB}")
    undo = cg.raise_limit(300 * MiB)
    assert (read(cg, "memory.max"), read(cg, "memory.high")) == (str(300 * MiB), str(300 * MiB))
    undo()
    assert (read(cg, "memory.max"), read(cg, "memory.high")) == (str(256 * MiB), str(200 * MiB))


def test_raise_limit_high_max_is_not_written_until_undo(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path, high=MAX)
    undo = cg.raise_limit(300 * MiB)
    assert read(cg, "memory.high") == "max\n"  # untouched
    undo()
    assert read(cg, "memory.high") == "max"
    assert read(cg, "memory.max") == str(256 * MiB)


def test_raise_limit_undo_is_repeatable(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path, high=f"{200 * MiB}")
    undo = cg.raise_limit(300 * MiB)
    undo()
    undo()
    assert (cg.limit(), cg.high()) == (256 * MiB, 200 * MiB)


def test_raise_limit_on_removed_cgroup(tmp_path: Path) -> None:
    cg = V2MemoryCgroup(tmp_path / "gone", tmp_path)
    with pytest.raises(CgroupGone):
        cg.raise_limit(300 * MiB)


# -- freezer -------------------------------------------------------------------------------------

def test_freeze_and_thaw_write_cgroup_freeze(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path)
    cg.freeze()
    assert read(cg, "cgroup.freeze") == "1"
    cg.thaw()
    assert read(cg, "cgroup.freeze") == "0"


@pytest.mark.parametrize("op", [V2MemoryCgroup.freeze, V2MemoryCgroup.thaw, V2MemoryCgroup.is_frozen])
def test_freezer_on_removed_cgroup(tmp_path: Path, op: Callable[[V2MemoryCgroup], object]) -> None:
    with pytest.raises(CgroupGone):
        op(V2MemoryCgroup(tmp_path / "gone", tmp_path))


@pytest.mark.parametrize(
    ("events", "frozen"),
    [
        ("populated 1\nfrozen 1\n", True),
        ("populated 1\nfrozen 1", True),
        ("frozen 1\npopulated 0\n", True),
        ("populated 1\nfrozen 0\n", False),
        ("populated 0\n", False),  # no 'frozen' key
        ("", False),
        ("populated 1\nfrozen 2\n", False),
    ],
)
def test_is_frozen(tmp_path: Path, events: str, frozen: bool) -> None:
    cg = v2_dir(tmp_path, cgroup_events=events)
    assert cg.is_frozen() is frozen


def test_wait_frozen_times_out(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path)
    start = time.monotonic()
    assert cg.wait_frozen(0.02) is False
    elapsed = time.monotonic() - start
    assert 0.02 <= elapsed < 1.0


def test_wait_frozen_fake_clock_times_out_at_deadline(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path)
    ticks = iter([100.0, 100.5, 100.9, 101.0, 200.0])
    calls: list[float] = []

    def clock() -> float:
        calls.append(next(ticks))
        return calls[-1]

    assert cg.wait_frozen(1.0, clock=clock) is False
    assert calls == [100.0, 100.5, 100.9, 101.0]  # gives up once the clock reaches the deadline


def test_wait_frozen_already_frozen(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path, cgroup_events="populated 1\nfrozen 1\n")
    assert cg.wait_frozen(0.0) is True


def test_wait_frozen_sees_freeze_complete(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path)
    now = [0.0]

    def clock() -> float:  # the kernel finishes freezing on the third look
        now[0] += 0.001
        if now[0] >= 0.003:
            (cg.path / "cgroup.events").write_text("populated 1\nfrozen 1\n")
        return now[0]

    assert cg.wait_frozen(1.0, clock=clock) is True


# -- snapshot events -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("events", "high", "max_", "oom_kills"),
    [
        ("low 0\nhigh 12\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n", 12, 3, 1),
        ("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", 0, 0, 0),
        ("low 5\noom 2\n", 0, 0, 0),  # counters missing: 0
        ("high 4294967296\nmax 7\noom_kill 9\n", 1 << 32, 7, 9),
    ],
)
def test_snapshot_events(tmp_path: Path, events: str, high: int, max_: int, oom_kills: int) -> None:
    snap = v2_dir(tmp_path, events=events).snapshot()
    assert (snap.high_events, snap.max_events, snap.oom_kills) == (high, max_, oom_kills)
    assert (snap.usage_bytes, snap.limit_bytes) == (200 * MiB, 256 * MiB)
    assert (snap.anon_bytes, snap.file_bytes, snap.under_oom) == (150 * MiB, 40 * MiB, False)


# -- v1 raise_limit ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("before", "new", "raised", "after_undo"),
    [
        (f"{256 * MiB}\n", 300 * MiB, str(300 * MiB), str(256 * MiB)),
        ("9223372036854771712\n", 300 * MiB, str(300 * MiB), "-1"),  # unlimited comes back as -1
    ],
    ids=["limited", "unlimited"],
)
def test_v1_raise_limit_undo(tmp_path: Path, before: str, new: int, raised: str, after_undo: str) -> None:
    path = tmp_path / "memory" / "jobs"
    path.mkdir(parents=True)
    (path / "memory.limit_in_bytes").write_text(before)
    cg = V1MemoryCgroup(path, tmp_path / "memory")
    undo = cg.raise_limit(new)
    assert read(cg, "memory.limit_in_bytes") == raised
    assert cg.limit() == new
    undo()
    assert read(cg, "memory.limit_in_bytes") == after_undo


def test_v1_raise_limit_on_removed_cgroup(tmp_path: Path) -> None:
    cg = V1MemoryCgroup(tmp_path / "memory" / "gone", tmp_path / "memory")
    with pytest.raises(CgroupGone):
        cg.raise_limit(300 * MiB)
