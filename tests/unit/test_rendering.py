"""Output for people (oomguard.observe.rendering, the console log, the progress bar) and for machines
(JSON log lines unchanged)."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from oomguard.cli.progress import BAR_WIDTH, progress, progress_line
from oomguard.observe.logsetup import configure_logging, get_logger
from oomguard.observe.rendering import (
    event_fields,
    human_value,
    humanize_event,
    list_text,
    local_time,
    one_line,
    restored_line,
    show_text,
    taken_line,
)

MiB = 1 << 20
CHECKPOINT_ID = "20250301-120000-4242-abcd"


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def far_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time 14 hours ahead of UTC, so local and UTC times cannot be confused."""
    monkeypatch.setenv("TZ", "XYZ-14")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("usage", 356950016, "340.4MiB"),
    ("limit", 400 * MiB, "400.0MiB"),
    ("image_bytes", 3 << 30, "3.0GiB"),
    ("rss", 512, "512B"),
    ("vram", 0, "0B"),
    ("pid", 356950016, 356950016),  # not a size
    ("usage", True, True),
    ("min_available", 0.1, 0.1),  # a fraction, not bytes
    ("usage", None, None),
])
def test_human_value(key: str, value: Any, shown: Any) -> None:
    assert human_value(key, value) == shown


def test_the_console_processor_changes_only_byte_fields() -> None:
    event = {"event": "threshold.crossed", "usage": 380 * MiB, "resident": 356950016,
             "limit": 400 * MiB, "cgroup": "/jobs/a", "pid": 42}
    assert humanize_event(None, "warning", dict(event)) == {
        "event": "threshold.crossed", "usage": "380.0MiB", "resident": "340.4MiB",
        "limit": "400.0MiB", "cgroup": "/jobs/a", "pid": 42}


def test_console_log_has_local_time_and_sizes(far_zone: None) -> None:
    out = Terminal()
    configure_logging("console", "info", stream=out)
    get_logger().warning("threshold.crossed", usage=380 * MiB, limit=400 * MiB, pid=42)
    line = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # colours off
    assert "usage=380.0MiB" in line and "limit=400.0MiB" in line and "pid=42" in line
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ", line)
    assert stamp, line
    # Read back as local time it is now; read as UTC it would be 14 hours off.
    assert abs(time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) - time.time()) \
        < 3600


def test_json_log_keeps_raw_numbers_and_utc(far_zone: None) -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    get_logger().warning("threshold.crossed", usage=380 * MiB, limit=400 * MiB)
    line = json.loads(out.getvalue())
    assert line["usage"] == 380 * MiB and line["limit"] == 400 * MiB
    assert line["timestamp"].endswith("Z") and "T" in line["timestamp"]


def test_event_times_are_local(far_zone: None) -> None:
    """restore.exited's exited_at (a Unix time) reads as a local time in `status`."""
    shown = human_value("exited_at", 1_740_830_400.5)
    assert shown == local_time(1_740_830_400.5, zone=False) == "2025-03-02 02:00:00"
    assert human_value("exited_at", None) is None and human_value("restored_at", 0) == 0


def test_status_event_fields_are_human() -> None:
    event = {"time": "2025-03-01T12:00:00", "level": "warning", "event": "threshold.crossed",
             "cgroup": "/jobs/a", "usage": 380 * MiB, "image_bytes": 2 * MiB}
    assert event_fields(event) == "cgroup=/jobs/a usage=380.0MiB image_bytes=2.0MiB"


def meta(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "id": CHECKPOINT_ID, "state": "checkpointed", "command": "python3 train.py",
        "pid": 4242, "pids": [4242, 4243], "pidns": False, "uid": 1000, "user": "alice",
        "cgroup": "/jobs/a", "cgroup_version": 1, "rss_bytes": 340 * MiB,
        "image_bytes": 342 * MiB, "vram_bytes": 0, "created": 1_740_830_400.0,
        "dump_seconds": 1.25, "reason": "resident 340.0MiB >= 85% of 400.0MiB",
        "restored_at": None, "restored_pid": None, "restored_cgroup": None,
        "exited_at": None, "exit_status": None, "exit_signal": None}
    values.update(changes)
    return values


def test_show_text_is_aligned_and_human(far_zone: None) -> None:
    lines = show_text(meta()).splitlines()
    assert lines == [
        "id        20250301-120000-4242-abcd",
        "state     checkpointed",
        "command   python3 train.py",
        "pid       4242 (2 tasks)",
        "user      alice (uid 1000)",
        "cgroup    /jobs/a (cgroup v1)",
        "resident  340.0MiB",
        "image     342.0MiB",
        f"created   {local_time(1_740_830_400.0)}",
        "dump      1.25s",
        "reason    resident 340.0MiB >= 85% of 400.0MiB",
        "restore   oomguard restore 20250301-120000-4242-abcd",
    ]
    assert local_time(1_740_830_400.0) == "2025-03-02 02:00:00 XYZ"  # 12:00 UTC, at UTC+14


def test_show_text_of_a_restored_checkpoint_that_ended(far_zone: None) -> None:
    text = show_text(meta(state="restored", restored_at=1_740_830_460.0, restored_pid=5151,
                          restored_cgroup="/jobs/big", exited_at=1_740_830_520.0,
                          exit_signal="SIGTERM", vram_bytes=2 << 30))
    assert "vram      2.0GiB" in text.splitlines()
    assert "restored  2025-03-02 02:01:00 XYZ as PID 5151 into /jobs/big" in text.splitlines()
    assert "exited    2025-03-02 02:02:00 XYZ by SIGTERM" in text.splitlines()
    assert text.splitlines()[-1] == "restore   already restored"


@pytest.mark.parametrize(("result", "line"), [
    ({"id": CHECKPOINT_ID, "pid": 5151, "was_pid": 4242, "cgroup": "/jobs/big"},
     f"restored {CHECKPOINT_ID} as PID 5151 (was 4242) into /jobs/big"),
    ({"id": CHECKPOINT_ID, "pid": 4242, "was_pid": 4242, "cgroup": None},
     f"restored {CHECKPOINT_ID} as PID 4242 (was 4242) (no cgroup)"),
])
def test_restored_line(result: dict[str, Any], line: str) -> None:
    assert restored_line(result) == line


def test_progress_line_with_and_without_a_total() -> None:
    assert progress_line("restore of x", 100 * MiB, 400 * MiB, 1.25) == (
        "restore of x: [#####...............]  25% 100.0MiB of 400.0MiB in 1.2s ")
    assert progress_line("checkpoint of 42", 3 * MiB, None, 0.5) == (
        "checkpoint of 42: 3.0MiB in 0.5s ")


def test_a_progress_bar_that_succeeds_ends_at_100_percent() -> None:
    out = Terminal()
    with progress("restore of x", lambda: 10 * MiB, out, total=400 * MiB, interval=0.01):
        pass
    final = out.getvalue().split("\r")[-1]
    assert f"[{'#' * BAR_WIDTH}] 100% 400.0MiB of 400.0MiB" in final
    assert final.endswith("\n")


def test_a_progress_bar_that_fails_does_not_claim_100_percent() -> None:
    out = Terminal()
    with pytest.raises(RuntimeError), \
            progress("restore of x", lambda: 10 * MiB, out, total=400 * MiB, interval=0.01):
        raise RuntimeError("CRIU failed")
    final = out.getvalue().split("\r")[-1]
    assert "100%" not in final and "of 400.0MiB" in final


def test_no_progress_on_a_pipe() -> None:
    out = io.StringIO()
    with progress("restore of x", lambda: 10 * MiB, out, total=400 * MiB, interval=0.01):
        pass
    assert out.getvalue() == ""


# -- the job's own command, on one line (issue 25, item 6) -------------------------------------

NSINIT_COMMAND = ("/work/.venv/bin/python3 -I /work/oomguard/terminal/nsinit.py --tty-fd 3 -- "
                  "python3 -c \nimport time\nfor i in range(9):\n\tprint(i)")


@pytest.mark.parametrize(("text", "width", "shown"), [
    ("python3 train.py", 40, "python3 train.py"),
    ("python3 -c \nimport x\n\tx.run()", 40, "python3 -c \\nimport x\\n\\tx.run()"),
    ("a\x1b[31mred\x07", 40, "a\\x1b[31mred\\x07"),  # no escape sequence reaches the terminal
    ("abcdefghij", 10, "abcdefghij"),
    ("abcdefghijk", 10, "abcdefghi\u2026"),
    ("a\nb\nc\nd\ne", 6, "a\\nb\u2026"),  # never cut inside an escape
    ("x" * 1_000_000, 8, "xxxxxxx\u2026"),
    ("abc", 0, "\u2026"),
])
def test_one_line(text: str, width: int, shown: str) -> None:
    assert one_line(text, width) == shown
    assert len(one_line(text, width)) <= max(width, 1) and "\n" not in one_line(text, width)


def exec_meta(**changes: Any) -> dict[str, Any]:
    return meta(command=NSINIT_COMMAND, pid=4242, pids=[4242, 4243, 4244], pidns=True,
                **changes)


def test_show_text_of_an_exec_job_names_cmd_and_the_pid_seen(far_zone: None) -> None:
    lines = show_text(exec_meta(job_command="python3 -c \nimport time\nfor i in range(9):\n"
                                "\tprint(i)", job_pid=4243), width=50).splitlines()
    assert lines[2] == "command   python3 -c \\nimport time\\nfor i in rang\u2026"
    assert len(lines[2]) == 50
    assert lines[3] == ("pid       4243 (the job's main process; its tree: 4242, its PID "
                        "namespace's init, 3 tasks)")


def test_show_text_of_an_older_exec_checkpoint_derives_cmd(far_zone: None) -> None:
    lines = show_text(exec_meta(), width=200).splitlines()
    assert lines[2] == "command   python3 -c \\nimport time\\nfor i in range(9):\\n\\tprint(i)"
    assert lines[3] == "pid       4242 (3 tasks, PID namespace init)"


def test_list_text_one_line_per_job_cut_to_the_width(far_zone: None) -> None:
    metas = [meta(), exec_meta(id="20250301-120500-4242-beef", job_pid=4243)]
    lines = list_text(metas, width=130).splitlines()
    assert len(lines) == 3 and all(len(line) <= 130 for line in lines)
    assert lines[0].split() == ["ID", "PID", "ROOT", "USER", "RSS", "IMAGE", "STATE", "CREATED",
                                "COMMAND"]
    assert lines[1].split()[:3] == [CHECKPOINT_ID, "4242", "4242"]
    assert lines[1].endswith("  python3 train.py")
    assert lines[2].split()[:3] == ["20250301-120500-4242-beef", "4243", "4242"]
    assert "nsinit" not in lines[2] and lines[2].endswith("\u2026")
    assert "  python3 -c \\nimport" in lines[2]
    wide = list_text(metas, width=300).splitlines()
    assert wide[2].endswith("python3 -c \\nimport time\\nfor i in range(9):\\n\\tprint(i)")


def test_event_lines_show_the_jobs_command_json_keeps_both() -> None:
    event = {"time": "2025-03-01T12:00:00", "level": "warning", "event": "checkpoint.done",
             "id": "x", "image_bytes": 2 * MiB, "command": NSINIT_COMMAND,
             "job_command": "python3 -c \nimport time", "job_pid": 4243}
    assert event_fields(event, width=200) == (
        "id=x job_pid=4243 command=python3 -c \\nimport time image_bytes=2.0MiB")
    cut = event_fields(event, width=50)
    assert cut == "id=x job_pid=4243 command=python3 -c \\nimport tim\u2026"
    # the command gets at most half of a wide line: the fields after it are seen
    wide = event_fields({**event, "job_command": "x" * 500}, width=120)
    assert wide.count("x") == 1 + 59 and wide.endswith("\u2026 image_bytes=2.0MiB")
    # an event from before job_command: the init's command line is read for CMD
    older = {k: v for k, v in event.items() if k != "job_command"}
    assert event_fields(older, width=200).endswith(
        "command=python3 -c \\nimport time\\nfor i in range(9):\\n\\tprint(i) image_bytes=2.0MiB")
    shown = humanize_event(None, "warning", dict(event))
    # (cut, not escaped: the console renderer escapes strings itself)
    assert shown["command"] == "python3 -c \nimport time" and "job_command" not in shown


def test_a_status_line_is_one_line_whatever_its_fields_hold() -> None:
    failed = {"event": "checkpoint.failed", "cgroup": "/jobs/a", "pid": 42, "outcome": "thawed",
              "error": "criu dump exited with status 1\n(00.1) Error (criu/tty.c:1): no tty"}
    line = event_fields(failed, width=80)
    assert line.startswith("cgroup=/jobs/a pid=42 outcome=thawed error=criu dump exited")
    assert "\n" not in line and len(line) == 80 and line.endswith("\u2026")
    assert "status 1\\n(00.1)" in event_fields(failed, width=200)


def test_console_log_of_a_checkpoint_is_one_line() -> None:
    out = Terminal()
    configure_logging("console", "info", stream=out)
    get_logger().warning("checkpoint.done", id="x", command=NSINIT_COMMAND)
    line = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert line.count("\n") == 1 and "nsinit" not in line
    assert "command='python3 -c \\nimport time\\nfor i" in line  # the renderer's escapes


def test_the_checkpoint_says_which_tree_it_took() -> None:
    taken = exec_meta(id="cid", job_command="python3 train.py", job_pid=4243)
    assert taken_line(taken, 4243) == (
        "oomguard: process 4243 is in the job of 4242 (its PID namespace's init): "
        "checkpointed the whole job, 3 processes: python3 train.py")
    assert taken_line(meta(id="cid", pids=[4242]), 4242) == (
        "oomguard: checkpointed the tree of 4242, 1 process: python3 train.py")
    cut = taken_line(exec_meta(), 4243, width=140)
    assert 138 <= len(cut) <= 140 and cut.endswith("3 processes: python3 -c \\nimport time\u2026")


def test_a_cut_ends_in_one_ellipsis() -> None:
    assert one_line("abc\u2026 def", 6) == "abc\u2026"
    assert one_line("abc def", 5) == "abc\u2026"
