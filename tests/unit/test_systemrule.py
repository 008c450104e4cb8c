"""System-wide rule arithmetic: MemAvailable floor, polling cadence, cgroup scoping, PSI."""

from __future__ import annotations

import pytest

from oomguard.detect.memavailable import floor_bytes, floor_reason
from oomguard.detect.psifull import pressure_reason
from oomguard.policy.systemrule import SYSTEM_MAX_POLL, in_cgroups, next_poll

GiB = 1 << 30


@pytest.mark.parametrize(("total", "floor", "expected"), [
    (16 * GiB, 0.10, int(16 * GiB * 0.10)),
    (16 * GiB, 2 * GiB, 2 * GiB),
    (16 * GiB, 1.0, 16 * GiB),
])
def test_floor_bytes(total: int, floor: float | int, expected: int) -> None:
    assert floor_bytes(total, floor) == expected


@pytest.mark.parametrize(("available", "floor", "minimum", "expected"), [
    (10 * GiB, GiB, 0.1, SYSTEM_MAX_POLL),  # far from the floor: once a second
    (GiB + 300_000_000, GiB, 0.1, 0.1),  # 300 MB away: 50 ms at 6 GB/s, kept at the minimum
    (GiB + 3_000_000_000, GiB, 0.1, 0.5),  # 3 GB away: half a second
    (GiB // 2, GiB, 0.1, 0.1),  # already below
])
def test_next_poll(available: int, floor: int, minimum: float, expected: float) -> None:
    assert next_poll(available, 16 * GiB, floor, minimum) == pytest.approx(expected)


def test_floor_reason_says_which_floor() -> None:
    assert floor_reason(GiB, 0.1) == "MemAvailable 1.0GiB at or below the floor (10% of MemTotal)"
    assert floor_reason(GiB, 2 * GiB) == "MemAvailable 1.0GiB at or below 2.0GiB"


@pytest.mark.parametrize(("rel", "roots", "expected"), [
    ("/user.slice/user-1000.slice/session-2.scope", ("/sys/fs/cgroup/memory/user.slice",), True),
    ("/user.slice", ("/user.slice",), True),
    ("/user.slicex/a", ("/user.slice",), False),  # a prefix of the name is not a parent
    ("/system.slice/sshd.service", ("/user.slice", "/jobs"), False),
    ("/anything", ("/",), True),
    ("/jobs/a", ("/sys/fs/cgroup/memory/jobs/",), True),
])
def test_in_cgroups(rel: str, roots: tuple[str, ...], expected: bool) -> None:
    assert in_cgroups(rel, "/sys/fs/cgroup/memory", roots) is expected


@pytest.mark.parametrize(("avg10", "threshold", "acts"), [
    (75.0, 0.60, True),
    (60.0, 0.60, True),  # at the threshold
    (59.9, 0.60, False),
    (99.0, None, False),  # off
])
def test_pressure_reason(avg10: float, threshold: float | None, acts: bool) -> None:
    reason = pressure_reason(avg10, threshold)
    assert (reason is not None) is acts
    if acts:
        assert reason == f"memory pressure: full avg10 {avg10:.1f}% >= {threshold:.0%}"
