"""oomguard.gpu.budget: host RAM for the VRAM copy a GPU checkpoint makes, and the cgroup limit it needs."""

from __future__ import annotations

import pytest

from oomguard.gpu.budget import HostBudget, host_budget

GiB = 1 << 30
MiB = 1 << 20


@pytest.mark.parametrize(
    ("usage", "limit", "available", "expected"),
    [
        # fits under the limit and in the machine
        (10 * GiB, 40 * GiB, 64 * GiB, HostBudget(True, 20 * GiB + 512 * MiB, None, "")),
        # exactly at the limit still fits
        (19 * GiB + 512 * MiB, 40 * GiB, 64 * GiB, HostBudget(True, 20 * GiB + 512 * MiB, None, "")),
        # over the cgroup's limit: lift it to usage + needed
        (30 * GiB, 40 * GiB, 64 * GiB, HostBudget(True, 20 * GiB + 512 * MiB, 50 * GiB + 512 * MiB, "")),
        # no cgroup limit: nothing to lift
        (30 * GiB, None, 64 * GiB, HostBudget(True, 20 * GiB + 512 * MiB, None, "")),
        # the machine is short: not ok, whatever the cgroup says
        (10 * GiB, None, 16 * GiB, HostBudget(False, 20 * GiB + 512 * MiB, None, "")),
        (30 * GiB, 40 * GiB, 20 * GiB, HostBudget(False, 20 * GiB + 512 * MiB, None, "")),
    ],
)
def test_host_budget(usage: int, limit: int | None, available: int, expected: HostBudget) -> None:
    got = host_budget(rss_bytes=8 * GiB, vram_bytes=20 * GiB, cgroup_usage=usage, cgroup_limit=limit,
                      mem_available=available, margin=512 * MiB)
    assert (got.ok, got.needed_bytes, got.raise_limit_to) == (
        expected.ok, expected.needed_bytes, expected.raise_limit_to)
    assert got.reason


def test_reasons_say_how_much() -> None:
    short = host_budget(8 * GiB, 20 * GiB, 10 * GiB, None, mem_available=16 * GiB, margin=512 * MiB)
    assert short.reason == ("GPU checkpoint needs 20.5GiB of host RAM, 4.5GiB more than available (16.0GiB)")
    lifted = host_budget(8 * GiB, 20 * GiB, 30 * GiB, 40 * GiB, mem_available=64 * GiB, margin=512 * MiB)
    assert "lifted to 50.5GiB" in lifted.reason


def test_no_vram_needs_only_the_margin() -> None:
    got = host_budget(GiB, 0, GiB, 2 * GiB, mem_available=4 * GiB, margin=256 * MiB)
    assert got == HostBudget(True, 256 * MiB, None, got.reason)
