"""CRIU runs in the host's mount namespace, whatever the daemon's own.

The service unit gives the daemon a read-only view of /usr, /boot, /etc and /home
(ProtectSystem=, ProtectHome=: a mount namespace of its own). CRIU must not run in it: a
task it dumps from the host's namespace would be one of another namespace (CRIU would dump
that namespace's mounts, or fail), and every task it restores would live on in the daemon's
read-only view. So where the daemon's mount namespace is not PID 1's, CRIU is started through
`nsenter --mount=/proc/1/ns/mnt` (criu.mount_namespace: "auto"; or the namespace it names) —
only where the CRIU binary is the very same file in that namespace, seen through its
process's /proc/PID/root (a container with a file system of its own keeps running CRIU as
before), and where the store is the very same directory there too. CRIU writes the images,
and the daemon then sums, sizes and verifies them through its own view: a store mounted
again in the daemon's namespace (an NFS export mounted twice, with `nosharecache`: another
superblock, its own page and attribute caches) showed the daemon a 110 MiB pages-1.img that
CRIU had just written through the other mount as empty, and the checkpoint it committed did
not verify.

Why nothing else of systemd's sandboxing is used (NoNewPrivileges=, SystemCallFilter=,
CapabilityBoundingSet=, RestrictAddressFamilies=...): those are inherited through CRIU by
every process it restores, and no CRIU can take them off again; a restored job would no
longer run sudo, or a syscall it used before."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

HOST_MOUNT_NS = "/proc/1/ns/mnt"


def host_mount_prefix(binary: str, setting: str = "auto",
                      proc_root: Path = Path("/proc"),
                      store: Path | None = None) -> tuple[str, ...]:
    """The argv prefix that runs `binary` in the host's mount namespace (criu.mount_namespace:
    "auto", PID 1's; a path, that namespace; "off", none), or () where no prefix is needed
    (the same namespace as ours) or none can be trusted: not the same CRIU file there (a
    container's own file system), not the same `store` directory there (another mount of
    it), no nsenter, the namespace not readable."""
    if setting == "off":
        return ()
    target = proc_root / "1" / "ns" / "mnt" if setting == "auto" else Path(setting)
    try:
        ours = os.stat(proc_root / "self" / "ns" / "mnt")
        host = os.stat(target)
    except OSError:
        return ()
    if (ours.st_dev, ours.st_ino) == (host.st_dev, host.st_ino):
        return ()
    path = shutil.which(binary) or binary
    try:
        here = os.stat(path)
        there = os.stat(target.parent.parent / "root" / path.lstrip("/"))
    except OSError:
        return ()
    nsenter = shutil.which("nsenter")
    if nsenter is None or (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
        return ()
    if store is not None and not same_directory_there(store, target.parent.parent / "root"):
        return ()
    return (nsenter, f"--mount={target}", "--")


def same_directory_there(path: Path, root: Path) -> bool:
    """Whether `path` (or, where it does not exist yet, its nearest existing parent) is the
    same directory, device and inode, seen under another namespace's `root`."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        here = os.stat(path)
        there = os.stat(root / str(path).lstrip("/"))
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
