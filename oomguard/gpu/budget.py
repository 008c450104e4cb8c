"""Host-RAM budget of a GPU checkpoint (pure).

cuda-checkpoint's checkpoint step copies the process's VRAM into its own host memory before CRIU
dumps it, so the process grows by about its VRAM, in the memory cgroup it already pressures.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.model.units import format_size


@dataclass(frozen=True)
class HostBudget:
    ok: bool
    needed_bytes: int  # host RAM the checkpoint adds: the VRAM plus a margin
    raise_limit_to: int | None  # lift the cgroup's limit to this for the checkpoint; None: no need
    reason: str


def host_budget(rss_bytes: int, vram_bytes: int, cgroup_usage: int, cgroup_limit: int | None,
                mem_available: int, margin: int) -> HostBudget:
    """Whether the host can take the VRAM copy, and the cgroup limit needed while it is taken.
    `rss_bytes` (the tree's resident memory, already counted in `cgroup_usage`) only informs `reason`."""
    needed = max(0, vram_bytes) + max(0, margin)
    if mem_available < needed:
        return HostBudget(
            ok=False, needed_bytes=needed, raise_limit_to=None,
            reason=(f"GPU checkpoint needs {format_size(needed)} of host RAM, "
                    f"{format_size(needed - mem_available)} more than available "
                    f"({format_size(mem_available)})"),
        )
    after = cgroup_usage + needed
    if cgroup_limit is not None and after > cgroup_limit:
        return HostBudget(
            ok=True, needed_bytes=needed, raise_limit_to=after,
            reason=(f"process {format_size(rss_bytes)} resident + {format_size(needed)} for VRAM: "
                    f"cgroup limit {format_size(cgroup_limit)} to be lifted to {format_size(after)}"),
        )
    return HostBudget(
        ok=True, needed_bytes=needed, raise_limit_to=None,
        reason=f"process {format_size(rss_bytes)} resident + {format_size(needed)} for VRAM fits",
    )
