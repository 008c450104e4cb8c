"""The trees oomguard paged out and keeps stopped until their memory fits again (the chain's
`pageout` step): a durable record in the store, so that neither a crash nor a restart continues
one into memory that is not there, and `oomguard resume` (or the daemon, once the tree fits)
knows what to continue and which swap files it needs.

Unlike the frozen ledger (a crash's stops, undone at the next start), an entry here is meant
to outlive the daemon: it is removed when the tree is resumed or has ended. Written whole and
fsync'd (a lost entry would leave a tree stopped with nobody to continue it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomguard.store.ledger import JsonRecord
from oomguard.store.names import PAGED_OUT


@dataclass(frozen=True)
class PagedOutTree:
    id: str  # "po-<root pid>-<milliseconds>": what `oomguard resume` and `list` name it by
    root_pid: int
    tasks: tuple[tuple[int, int], ...]  # (pid, start time) of each task oomguard stopped
    uid: int
    cgroup: str  # the cgroup's path relative to its hierarchy (as checkpoints say it)
    since: float  # wall-clock time of the page-out
    paged_bytes: int  # what process_madvise took the advice for
    resident_bytes: int  # the tree's resident memory when it was chosen (what comes back)
    command: str
    swap_files: tuple[str, ...] = ()  # oomguard's swap files made for it
    # The frozen cgroup v2 cgroup that holds it (oomguard.act.cgrouphold), or "": held by
    # SIGSTOP (cgroup v1, a traced tree, a tree over several cgroups)
    hold: str = ""

    @property
    def pids(self) -> list[int]:
        return [pid for pid, _ in self.tasks]


def _entry(data: object) -> PagedOutTree | None:
    if not isinstance(data, dict):
        return None
    try:
        return PagedOutTree(
            id=str(data["id"]), root_pid=int(data["root_pid"]),
            tasks=tuple((int(p), int(s)) for p, s in data["tasks"]), uid=int(data["uid"]),
            cgroup=str(data["cgroup"]), since=float(data["since"]),
            paged_bytes=int(data["paged_bytes"]), resident_bytes=int(data["resident_bytes"]),
            command=str(data.get("command", "")),
            swap_files=tuple(str(f) for f in data.get("swap_files", [])),
            hold=str(data.get("hold", "")))
    except (KeyError, TypeError, ValueError):
        return None


def _as_json(tree: PagedOutTree) -> dict[str, object]:
    return {**tree.__dict__, "tasks": [list(t) for t in tree.tasks],
            "swap_files": list(tree.swap_files)}


class PagedOutRecord:
    """STORE/.paged-out.json, shared by the daemon and the CLI (flock on a lock file beside
    it; each change reads, changes and writes the whole record)."""

    def __init__(self, store_root: Path) -> None:
        self.record = JsonRecord(store_root / PAGED_OUT, sync=True)

    def trees(self) -> list[PagedOutTree]:
        data = self.record.read()
        found = [_entry(item) for item in data] if isinstance(data, list) else []
        return [tree for tree in found if tree is not None]

    def add(self, tree: PagedOutTree) -> None:
        self._change(lambda trees: [*[t for t in trees if t.id != tree.id], tree])

    def remove(self, tree_id: str) -> None:
        self._change(lambda trees: [t for t in trees if t.id != tree_id])

    def find(self, key: str) -> PagedOutTree | None:
        """By id, or by the PID of any of its tasks (what `ps` shows)."""
        for tree in self.trees():
            if tree.id == key or (key.isdigit() and int(key) in tree.pids):
                return tree
        return None

    def swap_in_use(self) -> set[str]:
        return {path for tree in self.trees() for path in tree.swap_files}

    def _change(self, change: Callable[[list[PagedOutTree]], list[PagedOutTree]]) -> None:
        with self.record.locked():
            trees = change(self.trees())
            if trees:
                self.record.write([_as_json(t) for t in trees])
            else:
                self.record.remove()
