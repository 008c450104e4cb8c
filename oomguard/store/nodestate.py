"""Where a daemon keeps what belongs to its node alone: the crash records (the trees it stopped,
the limits it lifted, the oom_score_adj it set, the memory.high it changed, the trees it paged
out), its lock, its swap files, CRIU's action script and its recent events.

On a store of its own (a local file system) that is the store itself, as it always was. On a
store shared between nodes (NFS, Lustre, CephFS... mounted by every node at the same path, as
docs/cluster.md sets a cluster up) it cannot be: node B's daemon would read node A's
`.frozen.json` at its start and continue PIDs that are not its own, put back limits of
cgroups it does not have, and wait on the other node's lock. There the node's records go to
`/run/oomguard/state/<hash of the store's path>` (they describe processes and cgroups, which a
reboot ends anyway), or to `[daemon] state_dir` where one is configured. The checkpoints stay in
the shared store: their ids are unique across nodes, a dump in progress is a `.partial-` that
no node lists, and the flock on its lock file is seen by every node (on NFS an flock on a
file is a lock of the server's; on a directory it would be the client's alone)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

NODE_STATE_ROOT = Path("/run/oomguard/state")
# File systems another machine may write to at the same time (mountinfo's type field).
SHARED_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "fuse.ceph", "fuse.cephfs",
    "gpfs", "beegfs", "glusterfs", "fuse.glusterfs", "fuse.sshfs", "9p", "afs", "ocfs2",
    "gfs2", "fuse.juicefs", "fuse.s3fs", "virtiofs", "orangefs", "pvfs2"})


@dataclass(frozen=True)
class NodeState:
    """`path`: where this node's records live; `fs_type`: the store's file system type;
    `shared`: whether that file system may be written by other machines; `why`: one line."""

    path: Path
    fs_type: str
    shared: bool
    why: str


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_type(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str:
    """The type of the file system `path` lives on (its nearest existing ancestor's), by the
    longest mount point above it in mountinfo; "" where it cannot be read."""
    probe, rest = Path(os.path.abspath(path)), Path()
    while not probe.exists() and probe != probe.parent:
        probe, rest = probe.parent, Path(probe.name) / rest
    try:
        target = os.path.normpath(os.path.join(os.path.realpath(probe), rest))
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the last of equal mounts is on top
            best, kind = point, right.split()[0]
    return kind


def node_state(store: Path, configured: Path | None = None, *,
               mountinfo: Path = Path("/proc/self/mountinfo"),
               root: Path = NODE_STATE_ROOT) -> NodeState:
    """Where this node's records of the store at `store` live (module docstring)."""
    kind = mount_type(store, mountinfo)
    shared = kind in SHARED_FS_TYPES
    if configured is not None:
        return NodeState(configured, kind, shared, "[daemon] state_dir")
    if not shared:
        return NodeState(store, kind, False, "in the store (a file system of this node's)")
    digest = hashlib.sha256(os.path.abspath(store).encode()).hexdigest()[:16]
    return NodeState(root / digest, kind, True,
                     f"the store is on {kind}, which other nodes may share: this node's "
                     "records are kept apart from it")
