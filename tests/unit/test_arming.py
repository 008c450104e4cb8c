"""oomguard.daemon.arming: many guards armed from a pool of threads, every threshold mark
before any later mark, the replaced settings saved in one durable write before any is changed,
and a cgroup that is gone or refuses a registration told apart (v1 cgroups on a scratch tree;
the registrations recorded instead of made)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.watch import OOM_KILL_KEY, threshold_marks
from oomguard.config.loading import GuardConfig
from oomguard.daemon.arming import Armer
from oomguard.daemon.guards import CgroupGuard
from oomguard.store.ledger import SavedLimits
from tests.unit._support import MiB

LIMIT = 256 * MiB


class Journal:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[str, ...]] = []

    def add(self, *entry: str) -> None:
        with self.lock:
            self.entries.append(entry)


class RecordingV1(V1MemoryCgroup):
    """A v1 cgroup on a scratch tree whose registrations and writes are journalled."""

    journal: Journal
    refuse = False

    def register_threshold(self, threshold_bytes: int) -> int:
        if self.refuse:
            raise OSError(28, "No space left on device")
        self.journal.add("mark", self.path.name, str(threshold_bytes))
        return os.eventfd(0, os.EFD_CLOEXEC)

    def register_oom(self) -> int:
        self.journal.add("oom", self.path.name)
        return os.eventfd(0, os.EFD_CLOEXEC)

    def set_oom_kill_disable(self, disabled: bool) -> None:
        self.journal.add("oom_kill_disable", self.path.name, str(int(disabled)))


def make_cgroup(root: Path, name: str, journal: Journal) -> RecordingV1:
    path = root / name
    path.mkdir(parents=True)
    for file, text in (("memory.limit_in_bytes", f"{LIMIT}\n"),
                       ("memory.usage_in_bytes", f"{10 * MiB}\n"),
                       ("memory.stat", "total_rss 5242880\ntotal_cache 1048576\n"),
                       ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")):
        (path / file).write_text(text)
    cgroup = RecordingV1(path, root)
    cgroup.journal = journal
    return cgroup


class JournalledSaved(SavedLimits):
    def __init__(self, path: Path, journal: Journal) -> None:
        super().__init__(path)
        self.journal = journal

    def _save(self, data: dict[str, int | None]) -> None:
        self.journal.add("saved", str(len(data)))
        super()._save(data)


def snapshot_of(cgroup: MemoryCgroup) -> MemorySnapshot:
    return cgroup.snapshot()


@pytest.fixture
def journal() -> Journal:
    return Journal()


def guards_for(tmp_path: Path, journal: Journal, count: int, **spec: object) -> list[CgroupGuard]:
    rule = GuardConfig(cgroups=("x",), **spec)  # type: ignore[arg-type]
    return [CgroupGuard(spec=rule, cgroup=make_cgroup(tmp_path / "memory", f"c{i:02d}", journal))
            for i in range(count)]


def test_every_threshold_mark_comes_before_any_later_mark(tmp_path: Path, journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 12)
    saved = JournalledSaved(tmp_path / "saved.json", journal)
    prepared = Armer(snapshot_of, saved, "some 1 2", workers=4).arm(guards)
    assert [p.guard for p in prepared] == guards and all(p.error is None for p in prepared)
    first = threshold_marks(LIMIT, 0.85)[0]
    marks = [e for e in journal.entries if e[0] == "mark"]
    assert len(marks) == 12 * 3
    last_first = max(i for i, e in enumerate(marks) if e[2] == str(first))
    first_later = min(i for i, e in enumerate(marks) if e[2] != str(first))
    assert last_first < first_later, marks
    for guard in guards:  # each guard: 3 marks + the OOM notification, all open
        assert len(guard.fds) == 4
        for fd in guard.fds:
            os.fstat(fd)
            os.close(fd)
        assert guard.oom_disable_changed and not guard.oom_disable_original
        assert guard.detection == "v1 memory threshold eventfd + OOM notification"


def test_originals_are_saved_in_one_write_before_any_setting_changes(
        tmp_path: Path, journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 20)
    saved = JournalledSaved(tmp_path / "saved.json", journal)
    Armer(snapshot_of, saved, "some 1 2", workers=8).arm(guards)
    kinds = [e[0] for e in journal.entries]
    assert kinds.count("saved") == 1
    assert kinds.index("saved") < kinds.index("oom_kill_disable")
    assert kinds.count("oom_kill_disable") == 20
    assert saved.items() == {g.name + OOM_KILL_KEY: 0 for g in guards}
    for guard in guards:
        for fd in guard.fds:
            os.close(fd)


def test_a_dry_run_changes_no_setting_and_saves_nothing(tmp_path: Path, journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 3)
    saved = JournalledSaved(tmp_path / "saved.json", journal)
    Armer(snapshot_of, saved, "some 1 2", dry_run=True).arm(guards)
    assert not any(e[0] in ("saved", "oom_kill_disable") for e in journal.entries)
    assert all(len(g.fds) == 4 for g in guards)  # still watched: a dry run decides and logs
    for guard in guards:
        for fd in guard.fds:
            os.close(fd)


def test_gone_refused_and_unlimited_cgroups_are_told_apart(tmp_path: Path, journal: Journal) -> None:
    gone, refused, unlimited, fine = guards_for(tmp_path, journal, 4)
    for file in gone.cgroup.path.iterdir():
        file.unlink()
    gone.cgroup.path.rmdir()
    assert isinstance(refused.cgroup, RecordingV1)
    refused.cgroup.refuse = True
    (unlimited.cgroup.path / "memory.limit_in_bytes").write_text(f"{1 << 63}\n")
    saved = SavedLimits(tmp_path / "saved.json")
    by_guard = {p.guard.name: p for p in Armer(snapshot_of, saved, "", workers=4).arm(
        [gone, refused, unlimited, fine])}
    assert by_guard[gone.name].snapshot is None
    assert by_guard[refused.name].error is not None and "No space" in by_guard[refused.name].error
    assert by_guard[unlimited.name].snapshot is not None and not unlimited.fds
    assert by_guard[fine.name].error is None and len(fine.fds) == 4
    for guard in (refused, fine):
        for fd in guard.fds:
            os.close(fd)


def test_one_guard_is_armed_inline_without_a_pool(tmp_path: Path, journal: Journal) -> None:
    (guard,) = guards_for(tmp_path, journal, 1, time_to_limit=True)
    Armer(snapshot_of, SavedLimits(tmp_path / "s.json"), "").arm([guard])
    marks = [int(e[2]) for e in journal.entries if e[0] == "mark"]
    # time_to_limit: where growth starts being watched comes first, with the threshold
    assert marks[:2] == [int(LIMIT * 0.5), threshold_marks(LIMIT, 0.85)[0]]
    assert threading.active_count() >= 1
    for fd in guard.fds:
        os.close(fd)


def test_v2_memory_high_set_at_the_threshold_and_the_original_saved(tmp_path: Path) -> None:
    from oomguard.cgroup.v2 import V2MemoryCgroup
    root = tmp_path / "unified"
    paths = []
    for name, high in (("changed", "max"), ("users", str(100 * MiB))):
        path = root / name
        path.mkdir(parents=True)
        for file, text in (("memory.current", f"{10 * MiB}\n"), ("memory.max", f"{LIMIT}\n"),
                           ("memory.high", f"{high}\n"), ("memory.stat", "anon 1\nfile 2\n"),
                           ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"),
                           ("memory.pressure", "")):
            (path / file).write_text(text)
        paths.append(path)
    rule = GuardConfig(cgroups=("x",), psi=False)
    changed, users = (CgroupGuard(spec=rule, cgroup=V2MemoryCgroup(p, root)) for p in paths)
    saved = SavedLimits(tmp_path / "saved.json")
    prepared = Armer(snapshot_of, saved, "some 1 2", workers=2).arm([changed, users])
    assert all(p.error is None for p in prepared)
    mark = int(LIMIT * 0.85)
    assert (paths[0] / "memory.high").read_text() == str(mark)
    assert changed.high_set and changed.high_changed and changed.high_original is None
    # The user's memory.high at 100 MiB already throttles below the threshold: left alone.
    assert (paths[1] / "memory.high").read_text() == f"{100 * MiB}\n"
    assert users.high_set and not users.high_changed
    assert saved.items() == {changed.name: None}
    for guard in (changed, users):
        assert list(guard.fds.values()) == ["kernfs"]  # memory.events
        for fd in guard.fds:
            os.close(fd)
