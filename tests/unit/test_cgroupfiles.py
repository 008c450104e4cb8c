"""oomguard.sense.inotify and oomguard.sense.cgroupfiles: events parsed from kernel-format
bytes, and a real inotify instance on a scratch tree standing in for the cgroup filesystem
(writes, mkdir/rmdir, removal), which is what kernfs reports the same way."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from oomguard.sense.cgroupfiles import CgroupFiles, Changes, directories_to_watch, stamp
from oomguard.sense.inotify import (
    IN_CREATE,
    IN_IGNORED,
    IN_ISDIR,
    IN_MODIFY,
    IN_Q_OVERFLOW,
    InotifyEvent,
    parse_events,
)


def _event(wd: int, mask: int, name: bytes = b"") -> bytes:
    padded = name + b"\0" * (-len(name) % 16 or (16 if name else 0))
    return struct.pack("iIII", wd, mask, 0, len(padded)) + padded


def test_parse_events_kernel_layout() -> None:
    buffer = (_event(1, IN_CREATE | IN_ISDIR, b"job_42") + _event(2, IN_MODIFY)
              + _event(-1, IN_Q_OVERFLOW) + _event(3, IN_IGNORED))
    assert parse_events(buffer) == [
        InotifyEvent(1, IN_CREATE | IN_ISDIR, "job_42"), InotifyEvent(2, IN_MODIFY, ""),
        InotifyEvent(-1, IN_Q_OVERFLOW, ""), InotifyEvent(3, IN_IGNORED, "")]
    assert parse_events(buffer)[2].overflow and parse_events(buffer)[3].gone


def test_parse_events_drops_a_truncated_tail_and_odd_names() -> None:
    whole = _event(1, IN_CREATE, b"a\xffb")
    assert parse_events(whole + whole[:20]) == [InotifyEvent(1, IN_CREATE, os.fsdecode(b"a\xffb"))]
    assert parse_events(b"") == []


def test_directories_to_watch(tmp_path: Path) -> None:
    for uid in ("uid_1", "uid_2"):
        (tmp_path / "slurm" / uid / "job_1").mkdir(parents=True)
    (tmp_path / "slurm" / "not_a_dir").write_text("")
    slurm = tmp_path / "slurm"
    assert directories_to_watch(f"{slurm}/uid_*/job_*") == [
        str(slurm), str(slurm / "uid_1"), str(slurm / "uid_2")]
    assert directories_to_watch(f"{slurm}/uid_*/job_*/step_0") == [
        str(slurm), str(slurm / "uid_1"), str(slurm / "uid_2"),
        str(slurm / "uid_1" / "job_1"), str(slurm / "uid_2" / "job_1")]
    # Not there yet: the nearest ancestor that is, where it will be created.
    assert directories_to_watch(f"{tmp_path}/k8s/pod_*") == [str(tmp_path)]
    assert directories_to_watch(f"{tmp_path}/jobs/build") == [str(tmp_path)]


def test_a_limit_written_and_a_cgroup_removed_are_told(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    cg.mkdir()
    limit = cg / "memory.limit_in_bytes"
    limit.write_text("268435456\n")
    files = CgroupFiles()
    try:
        assert files.available and files.fileno() is not None
        assert files.watch_limit("cg", limit)
        assert not files.read()
        limit.write_text("536870912\n")
        assert files.read() == Changes(limits=frozenset({"cg"}))
        limit.unlink()
        cg.rmdir()
        assert files.read() == Changes(gone=frozenset({"cg"}))
        assert not files.read()  # the watch ended with the file
    finally:
        files.close()


def test_a_replaced_setting_written_is_told_apart_from_the_limit(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    cg.mkdir()
    limit, high = cg / "memory.max", cg / "memory.high"
    limit.write_text("268435456\n")
    high.write_text("228170137\n")
    files = CgroupFiles()
    try:
        assert files.watch_limit("cg", limit) and files.watch_setting("cg", high)
        high.write_text("268435456\n")  # a job scheduler's own memory.high
        assert files.read() == Changes(settings=frozenset({"cg"}))
        limit.write_text("536870912\n")
        assert files.read() == Changes(limits=frozenset({"cg"}))
        files.unwatch_setting("cg")
        high.write_text("max\n")
        assert not files.read()
        files.unwatch_limit("cg")
    finally:
        files.close()


def test_directories_report_entries_coming_and_going(tmp_path: Path) -> None:
    parent = tmp_path / "slurm"
    parent.mkdir()
    files = CgroupFiles()
    try:
        files.watch_directories({str(parent)})
        (parent / "job_1").mkdir()
        assert files.read() == Changes(directories=frozenset({str(parent)}))
        (parent / "job_1").rmdir()
        assert files.read().directories == {str(parent)}
        files.watch_directories(set())  # no longer watched: nothing more is told
        (parent / "job_2").mkdir()
        assert not files.read()
        assert files.watched_directories() == set()
    finally:
        files.close()


def test_two_rules_on_one_cgroup_both_hear_of_it(tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    files = CgroupFiles()
    try:
        files.watch_limit("a", limit)
        files.watch_limit("b", limit)
        files.unwatch_limit("a")
        limit.write_text("1G\n")
        assert files.read().limits == {"b"}
    finally:
        files.close()


def test_without_inotify_nothing_is_watched_and_the_reason_is_kept(tmp_path: Path) -> None:
    class NoInotify:
        def __init__(self) -> None:
            raise OSError(38, "Function not implemented")

    files = CgroupFiles(NoInotify)  # type: ignore[arg-type]
    assert not files.available and files.fileno() is None
    assert files.why is not None and "inotify unavailable" in files.why
    assert not files.watch_limit("cg", tmp_path / "x")
    files.watch_directories({str(tmp_path)})
    assert files.read() == Changes()


def test_stamp_changes_on_write_and_is_none_when_gone(tmp_path: Path) -> None:
    path = tmp_path / "memory.limit_in_bytes"
    path.write_text("1")
    first = stamp(path)
    os.utime(path, ns=(1, 1))
    assert stamp(path) != first and stamp(path) is not None
    path.unlink()
    assert stamp(path) is None
