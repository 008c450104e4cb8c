"""The identity (device, inode, owner, type) of every file a dumped tree had open or mapped,
recorded while it is stopped, and checked again before a restore: CRIU restores as root and
opens files by path, so a path swapped meanwhile (a symlink to a root-only file of the same
size) would hand the restored process a file its owner could never open."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

FILES_RECORD = "files.json"
DELETED = " (deleted)"


@dataclass(frozen=True)
class FileIdentity:
    path: str
    dev: int
    ino: int
    uid: int
    kind: int  # stat.S_IFMT of the mode: a regular file, a directory...


def _identity(path: str, st: os.stat_result) -> FileIdentity:
    return FileIdentity(path, st.st_dev, st.st_ino, st.st_uid, stat.S_IFMT(st.st_mode))


def _mapped_paths(maps_text: str) -> set[str]:
    """File-backed mappings of /proc/PID/maps (the sixth field, when it is a path)."""
    found = set()
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].endswith(DELETED):
            found.add(parts[5])
    return found


def record(pids: Iterable[int], proc_root: Path = Path("/proc")) -> list[FileIdentity]:
    """What the (stopped) tasks have open: regular files and directories behind their fds,
    their working directories and mapped files. Deleted files are skipped (CRIU keeps their
    contents in the images); so are pipes, sockets and devices (not opened by path)."""
    seen: dict[str, FileIdentity] = {}
    for pid in pids:
        base = proc_root / str(pid)
        links = [base / "cwd"]
        with contextlib.suppress(OSError):
            links += [base / "fd" / name for name in os.listdir(base / "fd")]
        for link in links:
            try:
                target = os.readlink(link)
                st = os.stat(link)  # the open file itself, not whatever its path names now
            except OSError:
                continue
            if not target.startswith("/") or target.endswith(DELETED):
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                seen.setdefault(target, _identity(target, st))
        try:
            mapped = _mapped_paths((base / "maps").read_text(errors="replace"))
        except OSError:
            continue
        for path in mapped - seen.keys():
            try:
                seen[path] = _identity(path, os.stat(path))
            except OSError:
                continue
    return sorted(seen.values(), key=lambda f: f.path)


def to_json(files: list[FileIdentity]) -> str:
    return json.dumps([asdict(f) for f in files], indent=1)


def from_json(text: str) -> list[FileIdentity]:
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{FILES_RECORD} is not a list")
    files = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or not all(
                isinstance(item.get(k), int) and not isinstance(item.get(k), bool)
                for k in ("dev", "ino", "uid", "kind")):
            raise ValueError(f"{FILES_RECORD} holds a malformed entry")
        files.append(FileIdentity(item["path"], item["dev"], item["ino"], item["uid"],
                                  item["kind"]))
    return files


def changed(files: Iterable[FileIdentity]) -> list[str]:
    """One line for each recorded file that CRIU, following the path as it does, would now
    open as something the process's owner did not have: a path that became a symlink, or a
    file of another owner or type (a file that is gone is CRIU's to report). A file its owner
    re-created at the same path (a rotated log, the output file a requeued Slurm job gets
    anew) is no such thing: CRIU's own size check decides about it."""
    problems = []
    for f in files:
        try:
            st = os.stat(f.path)
        except FileNotFoundError:
            continue  # nothing to be handed instead: CRIU's restore fails, naming it
        except OSError as exc:
            problems.append(f"{f.path} cannot be checked ({exc.strerror})")
            continue
        now = _identity(f.path, st)
        same = (now.dev, now.ino) == (f.dev, f.ino)
        if not same and os.path.islink(f.path):
            problems.append(f"{f.path} is another file than the one the process had open "
                            "(it is now a symlink)")
        elif now.uid != f.uid:
            what = "changed owner" if same else "is another file than the one the process " \
                "had open"
            problems.append(f"{f.path} {what} (owner uid {f.uid} -> {now.uid})")
        elif now.kind != f.kind:
            problems.append(f"{f.path} changed type")
    return problems
