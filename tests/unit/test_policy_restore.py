"""oomguard.policy.restore_fits: auto-restore only when resident memory + image + margin stays under
the mark (page cache is room)."""

from __future__ import annotations

import pytest

from oomguard.cgroup.base import MemorySnapshot
from oomguard.policy.pressure import restore_fits

MiB = 1 << 20
GiB = 1 << 30


def snap(usage: int, limit: int | None, *, anon: int = 0, under_oom: bool = False) -> MemorySnapshot:
    return MemorySnapshot(usage_bytes=usage, limit_bytes=limit, anon_bytes=anon, file_bytes=0,
                          oom_kills=0, under_oom=under_oom)


@pytest.mark.parametrize(
    ("usage", "limit", "image", "margin", "threshold", "fits"),
    [
        # no limit: anything fits
        (0, None, 0, 0, 0.8, True),
        (100 * GiB, None, 100 * GiB, 10 * GiB, 0.5, True),
        (0, None, 1, 0, 0.0, True),
        # the mark is threshold * limit: 768 MiB for 0.75 of 1 GiB
        (0, GiB, 0, 0, 0.75, True),
        (512 * MiB, GiB, 192 * MiB, 64 * MiB, 0.75, True),  # exactly at the mark
        (512 * MiB, GiB, 192 * MiB + 1, 64 * MiB, 0.75, False),  # one byte over
        (512 * MiB + 1, GiB, 192 * MiB, 64 * MiB, 0.75, False),  # usage one byte higher
        (512 * MiB, GiB, 192 * MiB, 64 * MiB + 1, 0.75, False),  # margin one byte larger
        # the margin matters: the same image fits without it and not with it
        (512 * MiB, GiB, 256 * MiB, 0, 0.75, True),
        (512 * MiB, GiB, 256 * MiB, 1, 0.75, False),
        (512 * MiB, GiB, 200 * MiB, 56 * MiB, 0.75, True),
        (512 * MiB, GiB, 200 * MiB, 57 * MiB, 0.75, False),
        # decimal numbers
        (500, 1000, 200, 100, 0.8, True),
        (500, 1000, 201, 100, 0.8, False),
        (500, 1000, 200, 101, 0.8, False),
        # threshold 1.0: up to the limit itself; 0.0: nothing but an empty restore into nothing
        (GiB - 10, GiB, 10, 0, 1.0, True),
        (GiB - 10, GiB, 10, 1, 1.0, False),
        (0, GiB, 0, 0, 0.0, True),
        (0, GiB, 1, 0, 0.0, False),
        # already over the mark: even an empty image does not fit
        (900 * MiB, GiB, 0, 0, 0.75, False),
        # a large image in an idle cgroup
        (0, 4 * GiB, 3 * GiB, 64 * MiB, 0.8, True),
        (0, 4 * GiB, 3 * GiB + 300 * MiB, 64 * MiB, 0.8, False),
    ],
)
def test_restore_fits(usage: int, limit: int | None, image: int, margin: int, threshold: float,
                      fits: bool) -> None:
    assert restore_fits(snap(usage, limit), image, margin, threshold) is fits


def test_page_cache_is_room_resident_memory_is_not() -> None:
    """The guard acts on resident memory (usage less page cache), and the kernel drops cache
    for the restore's pages: a cgroup full of its jobs' written files has room (the soak's
    restore cgroup sat at 1.96 of 2 GiB in cache with one 196 MiB job, and every restore into
    it was refused until the store's budget filled)."""
    cached = MemorySnapshot(usage_bytes=900 * MiB, limit_bytes=GiB, anon_bytes=100 * MiB,
                            file_bytes=800 * MiB, oom_kills=0, under_oom=False)
    assert restore_fits(cached, 600 * MiB, 64 * MiB, 0.75)  # 100 + 600 + 64 <= 768
    assert not restore_fits(cached, 605 * MiB, 64 * MiB, 0.75)
    # Kernel memory (usage beyond anon and cache) is not reclaimable: it counts.
    kernel = MemorySnapshot(usage_bytes=900 * MiB, limit_bytes=GiB, anon_bytes=100 * MiB,
                            file_bytes=300 * MiB, oom_kills=0, under_oom=False)
    assert restore_fits(kernel, 168 * MiB, 0, 0.75) and not restore_fits(kernel, 169 * MiB, 0, 0.75)


@pytest.mark.parametrize("limit", [1 * MiB, 100 * MiB, GiB, 16 * GiB])
@pytest.mark.parametrize("threshold", [0.5, 0.75, 0.875, 1.0])
def test_boundary_is_inclusive(limit: int, threshold: float) -> None:
    mark = int(threshold * limit)  # exact: binary fractions of powers of two
    margin = 4096
    usage = mark // 3
    image = mark - usage - margin
    assert restore_fits(snap(usage, limit), image, margin, threshold) is True
    assert restore_fits(snap(usage, limit), image + 1, margin, threshold) is False
    assert restore_fits(snap(usage, limit), image, margin + 1, threshold) is False
