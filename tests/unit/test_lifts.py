"""LimitLifts: lifts recorded before they happen, bounded, shared, put back by whoever can."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.act.lifts import LimitLifts
from oomguard.cgroup.base import LimitBusy
from oomguard.store.names import LIFTS_LEDGER

MiB = 1 << 20


class FakeCgroup:
    def __init__(self, path: Path, limit: int | None, usage: int) -> None:
        self.path = path
        self._limit = limit
        self.usage = usage
        self.writes: list[int | None] = []

    def limit(self) -> int | None:
        return self._limit

    def raise_limit(self, new_limit: int) -> object:
        self._limit = new_limit
        self.writes.append(new_limit)
        return lambda: None

    def limits_state(self) -> dict[str, int | None]:
        return {"max": self._limit}

    def put_back_limits(self, state: dict[str, int | None]) -> None:
        limit = state["max"]
        if limit is not None and self.usage > limit:
            raise LimitBusy(errno.EBUSY, f"usage {self.usage} is above the limit {limit}")
        self._limit = limit
        self.writes.append(limit)


@pytest.fixture
def lifts(tmp_path: Path) -> LimitLifts:
    return LimitLifts(tmp_path / "store" / LIFTS_LEDGER)


def test_lift_is_recorded_before_and_put_back_after(lifts: LimitLifts, tmp_path: Path) -> None:
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 190 * MiB)
    release = lifts.lift(cg, 254 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    assert cg.limit() == 254 * MiB
    on_disk = json.loads(lifts.ledger.read_text())
    assert on_disk[str(cg.path)]["state"] == {"max": 200 * MiB}
    assert lifts.lifted(cg.path) and lifts.own_limit(cg.path) == (True, 200 * MiB)
    assert release() is None
    assert cg.limit() == 200 * MiB
    assert not lifts.lifted(cg.path) and lifts.own_limit(cg.path) == (False, None)


def test_nested_lifts_keep_the_first_original_and_the_cap(lifts: LimitLifts,
                                                           tmp_path: Path) -> None:
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 199 * MiB)
    first = lifts.lift(cg, 263 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    cg.usage = 260 * MiB  # something grew into the room
    second = lifts.lift(cg, 340 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    assert cg.limit() == 328 * MiB, "never more than the own limit + 2 x headroom"
    cg.usage = 100 * MiB
    assert first() is None
    assert cg.limit() == 328 * MiB, "the second dump still needs its room"
    assert second() is None
    assert cg.limit() == 200 * MiB


def test_a_limit_that_cannot_be_put_back_stays_pending_until_it_can(
        lifts: LimitLifts, tmp_path: Path) -> None:
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 199 * MiB)
    release = lifts.lift(cg, 263 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    cg.usage = 250 * MiB
    assert "above the limit" in str(release())
    assert lifts.lifted(cg.path) and lifts.own_limit(cg.path) == (True, 200 * MiB)
    [busy] = lifts.settle(lambda path: cg)  # type: ignore[arg-type,return-value]
    assert busy.outcome == "busy"
    cg.usage = 120 * MiB
    [done] = lifts.settle(lambda path: cg)  # type: ignore[arg-type,return-value]
    assert done.outcome == "restored" and cg.limit() == 200 * MiB
    assert not lifts.pending()


def test_a_dead_holders_lift_is_put_back_by_the_next_process(tmp_path: Path) -> None:
    ledger = tmp_path / LIFTS_LEDGER
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 199 * MiB)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead_run = LimitLifts(ledger, owner=child.pid)
        dead_run.lift(cg, 263 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
        live = LimitLifts(ledger)
        assert live.settle(lambda path: cg) == []  # type: ignore[arg-type,return-value]
        assert cg.limit() == 263 * MiB, "its holder is alive: left alone"
    finally:
        child.kill()
        child.wait()
    [done] = LimitLifts(ledger).settle(lambda path: cg)  # type: ignore[arg-type,return-value]
    assert done.outcome == "restored" and cg.limit() == 200 * MiB


def test_a_vanished_cgroup_is_forgotten(lifts: LimitLifts, tmp_path: Path) -> None:
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 199 * MiB)
    release = lifts.lift(cg, 263 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    cg.usage = 300 * MiB
    assert release() is not None
    [gone] = lifts.settle(lambda path: None)
    assert gone.outcome == "gone" and not lifts.pending()


def test_no_lift_when_there_is_room_already(lifts: LimitLifts, tmp_path: Path) -> None:
    cg = FakeCgroup(tmp_path / "cg", None, 10 * MiB)
    release = lifts.lift(cg, 74 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    assert cg.writes == []
    assert release() is None
    assert cg.limit() is None


def test_a_limit_someone_else_set_meanwhile_is_left_and_its_entry_dropped(
        tmp_path: Path) -> None:
    """A dead run's entry, and an administrator who set 512 MiB since: not put back to 200."""
    ledger = tmp_path / LIFTS_LEDGER
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 150 * MiB)
    LimitLifts(ledger, owner=_dead_pid()).lift(cg, 214 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    assert json.loads(ledger.read_text())[str(cg.path)]["lifted"] == [214 * MiB]
    cg._limit = 512 * MiB  # the administrator
    live = LimitLifts(ledger)
    [left] = live.drop_changed(lambda path: cg)  # type: ignore[arg-type,return-value]
    assert left.outcome == "changed" and f"the limit is {512 * MiB}" in left.detail
    assert cg.limit() == 512 * MiB and cg.writes == [214 * MiB]
    assert not live.lifted(cg.path) and live.settle(lambda path: cg) == []  # type: ignore[arg-type,return-value]


def test_a_limit_still_as_lifted_is_put_back_and_not_taken_for_a_change(
        tmp_path: Path) -> None:
    ledger = tmp_path / LIFTS_LEDGER
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 150 * MiB)
    LimitLifts(ledger, owner=_dead_pid()).lift(cg, 214 * MiB + 100, cap=64 * MiB)  # type: ignore[arg-type]
    live = LimitLifts(ledger)
    cg._limit = (214 * MiB + 100) // 4096 * 4096  # as the kernel keeps it: whole pages
    assert live.drop_changed(lambda path: cg) == []  # type: ignore[arg-type,return-value]
    [done] = live.settle(lambda path: cg)  # type: ignore[arg-type,return-value]
    assert done.outcome == "restored" and cg.limit() == 200 * MiB


def test_a_live_holders_release_leaves_a_changed_limit_and_reports_no_trouble(
        lifts: LimitLifts, tmp_path: Path) -> None:
    cg = FakeCgroup(tmp_path / "cg", 200 * MiB, 250 * MiB)
    release = lifts.lift(cg, 264 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    cg._limit = 300 * MiB  # set by someone else while the dump ran
    assert release() is None
    assert cg.limit() == 300 * MiB and not lifts.lifted(cg.path)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


class ThrottledCgroup(FakeCgroup):
    """A v2 cgroup with the guard's memory.high below its limit."""

    def __init__(self, path: Path, limit: int, usage: int, high: int) -> None:
        super().__init__(path, limit, usage)
        self.high = high

    def raise_limit(self, new_limit: int) -> object:
        self.high = max(self.high, new_limit)
        return super().raise_limit(new_limit)

    def limits_state(self) -> dict[str, int | None]:
        return {"max": self._limit, "high": self.high}

    def put_back_limits(self, state: dict[str, int | None]) -> None:
        super().put_back_limits(state)
        self.high = state["high"] or 0


def test_a_memory_high_below_the_limit_is_lifted_though_the_limit_has_room(
        lifts: LimitLifts, tmp_path: Path) -> None:
    """A stopped task inside one system call, throttled at the guard's memory.high, would
    crawl past the stop's wait: lifted to the limit in force, and put back after."""
    cg = ThrottledCgroup(tmp_path / "cg", 256 * MiB, 186 * MiB, high=179 * MiB)
    release = lifts.lift(cg, 256 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    assert cg.high == 256 * MiB and cg.limit() == 256 * MiB
    assert lifts.lifted(cg.path) and lifts.own_limit(cg.path) == (True, 256 * MiB)
    assert release() is None
    assert cg.high == 179 * MiB and cg.limit() == 256 * MiB
    assert not lifts.lifted(cg.path)


def test_an_unthrottled_cgroup_with_room_is_not_touched(lifts: LimitLifts,
                                                        tmp_path: Path) -> None:
    cg = ThrottledCgroup(tmp_path / "cg", 256 * MiB, 186 * MiB, high=300 * MiB)
    release = lifts.lift(cg, 256 * MiB, cap=64 * MiB)  # type: ignore[arg-type]
    assert cg.writes == [] and cg.high == 300 * MiB
    assert release() is None
    assert cg.high == 300 * MiB and cg.limit() == 256 * MiB


class RoomCgroup:
    """A v2 cgroup as DumpRoom reads it (usage() and limit()) and LimitLifts writes it."""

    def __init__(self, path: Path, limit: int, used: int, high: int) -> None:
        self.path, self._limit, self.used, self.high = path, limit, used, high
        self.writes: list[tuple[int | None, int | None]] = []

    def usage(self) -> int:
        return self.used

    def limit(self) -> int:
        return self._limit

    def limits_state(self) -> dict[str, int | None]:
        return {"max": self._limit, "high": self.high}

    def raise_limit(self, new_limit: int) -> object:
        self.high, self._limit = max(self.high, new_limit), new_limit
        self.writes.append((self._limit, self.high))
        return lambda: None

    def put_back_limits(self, state: dict[str, int | None]) -> None:
        self._limit, self.high = state["max"] or 0, state["high"] or 0
        self.writes.append((self._limit, self.high))


def test_the_stops_unthrottle_records_nothing_where_no_memory_high_throttles(
        lifts: LimitLifts, tmp_path: Path) -> None:
    from oomguard.lifecycle.dumproom import DumpRoom
    room = DumpRoom(lifts)
    calm = RoomCgroup(tmp_path / "calm", 256 * MiB, 186 * MiB, high=300 * MiB)
    assert room.over(calm, 64 * MiB, own=True, undo=None, unthrottle=True) is None  # type: ignore[arg-type]
    assert not lifts.lifted(calm.path) and calm.writes == []
    throttled = RoomCgroup(tmp_path / "hot", 256 * MiB, 186 * MiB, high=179 * MiB)
    release = room.over(throttled, 64 * MiB, own=True, undo=None, unthrottle=True)  # type: ignore[arg-type]
    assert release is not None and throttled.high == 256 * MiB
    assert release() is None and throttled.high == 179 * MiB
