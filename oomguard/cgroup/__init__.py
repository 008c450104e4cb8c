"""Memory cgroups, v1 and v2, behind one protocol (`MemoryCgroup`)."""

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.mounts import CgroupLayout, open_cgroup, read_layout
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup

__all__ = [
    "CgroupLayout",
    "MemoryCgroup",
    "MemorySnapshot",
    "V1MemoryCgroup",
    "V2MemoryCgroup",
    "open_cgroup",
    "read_layout",
]
