"""oomguard.observe.history: the daemon's events of note kept in the store across restarts."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from oomguard.observe.history import EventHistory
from oomguard.observe.logsetup import RecordingLogger


class Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    warning = error = debug = info


def test_a_new_logger_starts_with_the_events_the_last_one_kept(tmp_path: Path) -> None:
    first = RecordingLogger(Sink(), keep=5, history=EventHistory(tmp_path, keep=5))
    first.info("guard.armed", cgroup="/a")  # routine: not kept
    for n in range(7):
        first.info("checkpoint.done", id=f"c{n}", pid=100 + n)
    first.warning("restore.failed", id="c6", error="no room")
    assert stat.S_IMODE((tmp_path / ".history.jsonl").stat().st_mode) == 0o600
    second = RecordingLogger(Sink(), keep=5, history=EventHistory(tmp_path, keep=5))
    assert [e.get("id") for e in second.recent] == ["c3", "c4", "c5", "c6", "c6"]
    assert second.recent[-1]["event"] == "restore.failed"


def test_the_file_is_trimmed_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    history = EventHistory(tmp_path, keep=3, trim_at=2)
    log = RecordingLogger(Sink(), keep=3, history=history)
    for n in range(20):
        log.info("checkpoint.done", id=f"c{n}")
        assert len((tmp_path / ".history.jsonl").read_text().splitlines()) < 6
    with (tmp_path / ".history.jsonl").open("a") as f:
        f.write('{"event": "checkpoint.do')  # a write cut by a crash
    assert [e["id"] for e in EventHistory(tmp_path, keep=3).load()] == ["c17", "c18", "c19"]


def test_no_history_and_an_unwritable_one_are_not_errors(tmp_path: Path) -> None:
    assert EventHistory(tmp_path / "absent").load() == []
    log = RecordingLogger(Sink(), history=EventHistory(tmp_path / "absent"))
    log.info("checkpoint.done", id="x")  # the store is gone: the history only is lost
    assert [e["id"] for e in log.recent] == ["x"]
