"""oomguard.daemon.arming: many guards armed from a pool of threads, every threshold mark
before any later mark (those come from beside the loop: LaterMarks), the replaced settings
saved in one durable write before any is changed, and a cgroup that is gone or refuses a
registration told apart (v1 cgroups on a scratch tree; the registrations recorded instead of
made)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.watch import OOM_KILL_KEY, Replaced, threshold_marks
from oomguard.config.loading import GuardConfig
from oomguard.daemon.arming import Armer, LaterMarks, Marks, Prepared
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
    refuse_after = -1  # refuse once this many marks are in (-1: never)
    opened: list[int]

    def register_threshold(self, threshold_bytes: int) -> int:
        if self.refuse or len(self.opened) == self.refuse_after:
            raise OSError(28, "No space left on device")
        self.journal.add("mark", self.path.name, str(threshold_bytes))
        fd = os.eventfd(0, os.EFD_CLOEXEC)
        self.opened.append(fd)
        return fd

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
    cgroup.opened = []
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


def later_batch(prepared: list[Prepared]) -> list[tuple[Prepared, int]]:
    return [(p, p.guard.generation) for p in prepared if p.later]


def close_all(guards: list[CgroupGuard], marks: Sequence[Marks] = ()) -> None:
    for fd in [fd for g in guards for fd in g.fds] + [fd for m in marks for fd in m.fds]:
        os.close(fd)


def test_every_threshold_mark_comes_before_any_later_mark(tmp_path: Path, journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 12)
    saved = JournalledSaved(tmp_path / "saved.json", journal)
    armer = Armer(snapshot_of, saved, "some 1 2", workers=4)
    prepared = armer.arm(guards)
    assert [p.guard for p in prepared] == guards and all(p.error is None for p in prepared)
    first = threshold_marks(LIMIT, 0.85)[0]
    assert [e[2] for e in journal.entries if e[0] == "mark"] == [str(first)] * 12
    for guard in guards:  # armed: the threshold mark + the OOM notification, open
        assert sorted(guard.fds.values()) == ["eventfd", "eventfd"]
        for fd in guard.fds:
            os.fstat(fd)
        assert guard.replaced.oom_disable_changed and not guard.replaced.oom_disable_original
        assert guard.detection == "v1 memory threshold eventfd + OOM notification"
    assert all(p.later for p in prepared)
    marks = armer.register_later(later_batch(prepared))
    assert sorted(m.guard.name for m in marks) == sorted(g.name for g in guards)
    later = threshold_marks(LIMIT, 0.85)[1:]
    made = [int(e[2]) for e in journal.entries if e[0] == "mark"][12:]
    assert sorted(made) == sorted(later * 12)
    for one in marks:  # handed back, not added: the loop adds them
        assert one.error is None and len(one.fds) == 2 and not set(one.fds) & set(one.guard.fds)
        assert one.generation == 0
    close_all(guards, marks)


def test_later_marks_come_from_a_thread_and_wake_the_loop(tmp_path: Path,
                                                         journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 5)
    armer = Armer(snapshot_of, SavedLimits(tmp_path / "s.json"), "", workers=2)
    prepared = armer.arm(guards)
    woken = threading.Event()
    later = LaterMarks(armer, on_done=woken.set)
    assert not later.waiting() and later.take() == []
    guards[0].generation = 7  # read when the batch starts, in the caller's thread
    later.start(prepared)
    assert woken.wait(10)
    later.join()
    assert later.waiting()
    marks = later.take()
    assert not later.waiting() and later.take() == []
    assert sorted(m.guard.name for m in marks) == sorted(g.name for g in guards)
    assert {m.guard.name: m.generation for m in marks}[guards[0].name] == 7
    assert all(len(m.fds) == 2 and m.error is None for m in marks)
    close_all(guards, marks)


def test_a_refused_later_mark_leaves_none_open_and_says_why(tmp_path: Path,
                                                            journal: Journal) -> None:
    (guard,) = guards_for(tmp_path, journal, 1)
    armer = Armer(snapshot_of, SavedLimits(tmp_path / "s.json"), "")
    prepared = armer.arm([guard])
    assert isinstance(guard.cgroup, RecordingV1)
    guard.cgroup.refuse_after = 2  # the threshold mark and one later mark, then ENOSPC
    (marks,) = armer.register_later(later_batch(prepared))
    assert marks.fds == [] and marks.error is not None and "No space" in marks.error
    later_fd = guard.cgroup.opened[1]
    with pytest.raises(OSError):
        os.fstat(later_fd)  # the one later mark made was closed
    close_all([guard])


def test_nothing_is_started_where_no_later_marks_follow(tmp_path: Path, journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 2, events=False)
    armer = Armer(snapshot_of, SavedLimits(tmp_path / "s.json"), "")
    prepared = armer.arm(guards)
    assert not any(p.later for p in prepared)
    later = LaterMarks(armer, on_done=lambda: pytest.fail("no batch to wake for"))
    later.start(prepared)
    later.join()
    assert later.take() == []


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
    close_all(guards)


def test_a_dry_run_changes_no_setting_and_saves_nothing(tmp_path: Path, journal: Journal) -> None:
    guards = guards_for(tmp_path, journal, 3)
    saved = JournalledSaved(tmp_path / "saved.json", journal)
    prepared = Armer(snapshot_of, saved, "some 1 2", dry_run=True).arm(guards)
    assert not any(e[0] in ("saved", "oom_kill_disable") for e in journal.entries)
    # still watched: a dry run decides and logs
    assert all(len(g.fds) == 2 for g in guards) and all(p.later for p in prepared)
    close_all(guards)


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
    assert by_guard[fine.name].error is None and len(fine.fds) == 2
    assert by_guard[fine.name].later and not by_guard[refused.name].later
    assert not by_guard[gone.name].later and not by_guard[unlimited.name].later
    close_all([refused, fine])


def test_one_guard_is_armed_inline_without_a_pool(tmp_path: Path, journal: Journal) -> None:
    (guard,) = guards_for(tmp_path, journal, 1, signals=(("time_to_limit", True),))
    before = threading.active_count()
    Armer(snapshot_of, SavedLimits(tmp_path / "s.json"), "").arm([guard])
    marks = [int(e[2]) for e in journal.entries if e[0] == "mark"]
    # time_to_limit: where growth starts being watched comes with the threshold, both first
    assert marks == [int(LIMIT * 0.5), threshold_marks(LIMIT, 0.85)[0]]
    assert threading.active_count() == before
    close_all([guard])


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
    assert changed.replaced == Replaced(high_set=True, high_changed=True, high_original=None)
    # The user's memory.high at 100 MiB already throttles below the threshold: left alone.
    assert (paths[1] / "memory.high").read_text() == f"{100 * MiB}\n"
    assert users.replaced == Replaced(high_set=True)
    assert saved.items() == {changed.name: None}
    for guard in (changed, users):
        assert list(guard.fds.values()) == ["kernfs"]  # memory.events
        for fd in guard.fds:
            os.close(fd)


def test_v2_memory_high_follows_a_raised_limit_and_the_original_stays(tmp_path: Path) -> None:
    """Armed again after the limit was raised (a person gives a checkpointed job room before
    restoring it): memory.high oomguard set for the old limit is its own, not a user's value
    below the threshold, and moves to the new threshold; the user's original is kept. (It was
    left where it was: the restored job crawled, throttled at the old threshold.)"""
    from oomguard.cgroup.v2 import V2MemoryCgroup
    path = tmp_path / "unified" / "job"
    path.mkdir(parents=True)
    for file, text in (("memory.current", f"{10 * MiB}\n"), ("memory.max", f"{LIMIT}\n"),
                       ("memory.high", "max\n"), ("memory.stat", "anon 1\nfile 2\n"),
                       ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"),
                       ("memory.pressure", "")):
        (path / file).write_text(text)
    rule = GuardConfig(cgroups=("x",), psi=False)
    saved = SavedLimits(tmp_path / "saved.json")
    first = CgroupGuard(spec=rule, cgroup=V2MemoryCgroup(path, tmp_path / "unified"))
    Armer(snapshot_of, saved, "").arm([first])
    assert (path / "memory.high").read_text() == str(int(LIMIT * 0.85))
    for fd in first.fds:
        os.close(fd)
    (path / "memory.max").write_text(f"{4 * LIMIT}\n")  # the limit raised
    again = CgroupGuard(spec=rule, cgroup=V2MemoryCgroup(path, tmp_path / "unified"))
    (prepared,) = Armer(snapshot_of, saved, "").arm([again])
    assert prepared.error is None
    assert (path / "memory.high").read_text() == str(int(4 * LIMIT * 0.85))
    assert again.replaced.high_changed and again.replaced.high_original is None
    assert saved.items() == {again.name: None}  # the user's original: max
    for fd in again.fds:
        os.close(fd)


def test_held_batches_start_only_when_released(tmp_path: Path, journal: Journal) -> None:
    """At start the daemon holds the later marks until its first look at every cgroup is done
    (READY=1 waits for nothing else); batches armed meanwhile all start then."""
    first, second = guards_for(tmp_path, journal, 2)
    armer = Armer(snapshot_of, SavedLimits(tmp_path / "s.json"), "")
    later = LaterMarks(armer, on_done=lambda: None)
    later.hold()
    later.start(armer.arm([first]))
    later.start(armer.arm([second]))
    later.join()
    assert not later.waiting()
    assert len([e for e in journal.entries if e[0] == "mark"]) == 2  # the thresholds only
    later.release()
    later.join()
    marks = later.take()
    assert sorted(m.guard.name for m in marks) == [first.name, second.name]
    later.start(armer.arm([]))  # released: nothing held any more, nothing to start
    close_all([first, second], marks)
