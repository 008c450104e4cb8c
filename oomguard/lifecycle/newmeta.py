"""What a new checkpoint says of the tree it holds (its meta.json, before the dump): who, what,
where, why, and the PIDs a restore needs free, as the tree stopped."""

from __future__ import annotations

import pwd

from oomguard.act.criu import format_version
from oomguard.cgroup.base import MemoryCgroup
from oomguard.policy.jobs import job_fields
from oomguard.policy.victims import ProcessTree
from oomguard.sense.owners import owner_fields
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import CheckpointMeta


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def describe_tree(checkpoint_id: str, tree: ProcessTree, cgroup: MemoryCgroup | None,
                  reason: str, criu_version: tuple[int, ...], created: float,
                  dump_seconds: float = 0.0) -> CheckpointMeta:
    root = tree.root
    return CheckpointMeta(
        id=checkpoint_id, pid=root.pid, pids=list(tree.pids), command=root.command,
        comm=root.comm, uid=root.uid, user=user_name(root.uid),
        cgroup=cgroup.rel_path if cgroup is not None else "",
        cgroup_version=cgroup.version if cgroup is not None else 0,
        rss_bytes=tree.rss_bytes, reason=reason,
        criu_version=format_version(criu_version), created=created,
        pidns=root.is_pidns_init, dump_seconds=round(dump_seconds, 3),
        extra=owner_fields(cgroup.rel_path) if cgroup is not None else {}, **job_fields(tree),
    )


def ns_pids(proc: ProcReader, pids: list[int]) -> list[int]:
    """PIDs in the tree's own PID namespace (NSpid's last field): what a restore maps back
    to host PIDs (a tree started by `oomguard exec` gets new host PIDs)."""
    return sorted(info.nspid[-1] for info in proc.processes(pids))

