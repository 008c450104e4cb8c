"""The store's budget, as systemd-coredump and journald keep theirs: the store may hold at
most `cap` bytes, and the file system it lives on keeps `keep_free` bytes free. Both are
configured as a size or as a share of the file system (resolved here against its size). Pure:
the readings come from oomguard.store.budget."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.model.units import format_size

Limit = int | float | None  # bytes, a share of the file system (a float below 1), or none

# What a checkpoint writes beside its memory pages: CRIU's metadata images, its dump.log at -v4
# and the restore.log a restore adds to the same directory later, outside any reservation.
IMAGE_OVERHEAD = 4 << 20


def image_estimate(resident: int, growth: int = 0) -> int:
    """The room a checkpoint of a tree with `resident` bytes (RAM and VRAM) takes in the store:
    its pages, what it may still grow by before it is stopped (`growth`: the room left under its
    cgroup's limit, where there is one), a 1/32 share for page maps and their kin, and the
    fixed IMAGE_OVERHEAD. An over-estimate, so that the store never goes over its cap."""
    return resident + max(growth, 0) + resident // 32 + IMAGE_OVERHEAD


def resolve(limit: Limit, total: int) -> int | None:
    """A configured limit in bytes on a file system of `total` bytes (None: no limit)."""
    if limit is None:
        return None
    if isinstance(limit, float):
        return int(total * limit)
    return limit


@dataclass(frozen=True)
class BudgetReading:
    """The store's use against its budget, in bytes: `used` by the store, its `cap` (None:
    none), `free` on its file system (for an unprivileged writer) of `total`, and the
    `keep_free` it must keep (0: none)."""

    used: int
    cap: int | None
    free: int
    keep_free: int
    total: int

    def excess(self, need: int = 0) -> int:
        """Bytes to free so that `need` more fits (0: it fits as it is)."""
        over_cap = 0 if self.cap is None else self.used + need - self.cap
        under_free = self.keep_free + need - self.free
        return max(over_cap, under_free, 0)

    def fits(self, need: int) -> bool:
        return self.excess(need) == 0

    def over(self) -> bool:
        """Past the budget now (a dump larger than its estimate, another writer's files)."""
        return self.excess() > 0

    def fields(self) -> dict[str, int | None]:
        return {"used": self.used, "cap": self.cap, "free": self.free,
                "keep_free": self.keep_free}

    def describe(self) -> str:
        """'store 30.0MiB used of its 32.0MiB cap; 40.0MiB free on its file system, which
        keeps 9.6MiB free'."""
        cap = "no cap" if self.cap is None else f"its {format_size(self.cap)} cap"
        keep = f", which keeps {format_size(self.keep_free)} free" if self.keep_free else ""
        return (f"store {format_size(self.used)} used of {cap}; "
                f"{format_size(self.free)} free on its file system{keep}")

    def refusal(self, need: int) -> str:
        """Why a checkpoint of about `need` bytes is refused (one line)."""
        return (f"the store's budget has no room for a checkpoint of ~{format_size(need)} "
                f"({self.describe()}); only restored checkpoints are pruned to make room, "
                "and none was left to prune")
