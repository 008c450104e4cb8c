"""The pure parts of terminals for jobs typed at a shell prompt and of the attach frames: what
CRIU could not restore (said before anything is stopped), which terminal a restore gives the
job, a checkpoint's images read for a terminal of an outside session, the frames and the job's
state, and a holder's view of its pty (a real pty, a real child stopped and continued)."""

from __future__ import annotations

import os
import signal
import struct
import time
from pathlib import Path

import pytest

from oomguard.terminal.jobprocs import foreground_of, proc_state, session_of, waiting_in_poll
from oomguard.terminal.shelljob import (
    ShellTty,
    TaskTerminal,
    images_hold_shell_terminal,
    outside_terminals,
    refusal,
    shell_tty_of,
)
from oomguard.terminal.wire import (
    INPUT,
    OUTPUT,
    STATE,
    FrameReader,
    JobState,
    describe_end,
    frame,
    json_frame,
    shell_status,
)

PTS3 = (0x8803, 0x1A, 3)
PTS5 = (0x8805, 0x1A, 5)


def task(pid: int, session: int, pgrp: int, *, tty_nr: int = 0,
         slaves: tuple[tuple[int, int, int], ...] = (), masters: tuple[int, ...] = (),
         ) -> TaskTerminal:
    return TaskTerminal(pid, f"p{pid}", session, pgrp, tty_nr, slaves, masters)


def test_a_job_typed_at_a_prompt_restores_onto_one_terminal() -> None:
    # python3 train.py typed in bash (pid 10): its own group, the shell's session.
    tree = [task(20, 10, 20, tty_nr=0x8803, slaves=(PTS3,)),
            task(21, 10, 20, tty_nr=0x8803, slaves=(PTS3,))]
    assert refusal(tree) is None
    assert shell_tty_of(tree) == ShellTty(0x8803, 0x1A, 3)
    # A pipeline's second member: its group is led outside the tree by the first one.
    assert refusal([task(31, 10, 30, slaves=(PTS3,))]) is None


def test_what_criu_could_not_restore_is_said_before_anything_is_stopped() -> None:
    two_sessions = [task(20, 10, 20), task(21, 11, 20)]
    assert "2 sessions led outside it (10, 11)" in (refusal(two_sessions) or "")
    foreign_group = [task(20, 10, 20), task(21, 10, 99)]
    assert "task 21 (p21) is in process group 99" in (refusal(foreign_group) or "")
    two_terminals = [task(20, 10, 20, slaves=(PTS3, PTS5))]
    assert refusal(two_terminals) == ("it holds 2 terminals of sessions led outside it "
                                      "(/dev/pts/3, /dev/pts/5): CRIU restores one")
    assert shell_tty_of(two_terminals) is None


def test_terminals_the_tree_leads_or_holds_both_ends_of_are_not_the_shells() -> None:
    # oomguard exec's init leads its session: its pty is an external one, not a shell's.
    exec_job = [task(40, 40, 40, tty_nr=0x8805, slaves=(PTS5,)),
                task(41, 40, 41, slaves=(PTS5,))]
    assert refusal(exec_job) is None and shell_tty_of(exec_job) is None
    # A pty whose master the tree holds (a tmux server in the tree) is CRIU's ordinary case.
    both_ends = [task(50, 10, 50, slaves=(PTS3, PTS5), masters=(5,))]
    assert outside_terminals(both_ends) == [PTS3]
    assert refusal(both_ends) is None


def record(fields: dict[int, int]) -> bytes:
    """A CRIU image record: a 4-byte little-endian length, then the protobuf varints."""
    body = b""
    for number, value in fields.items():
        body += _varint(number << 3) + _varint(value)
    return len(body).to_bytes(4, "little") + body


def _varint(value: int) -> bytes:
    out = b""
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


@pytest.mark.parametrize(("tty_sid", "rdev", "expected"), [
    (11795, os.makedev(136, 0), True),  # a pts of the shell's session: the tree lacks it
    (31227, os.makedev(136, 0), False),  # a session the tree leads (oomguard exec's)
    (0, os.makedev(136, 0), False),  # no session
    (11795, os.makedev(5, 2), False),  # not a pts slave
])
def test_a_checkpoint_without_the_record_is_read_from_its_images(
        tmp_path: Path, tty_sid: int, rdev: int, expected: bool) -> None:
    magic = b"\0" * 8
    (tmp_path / "pstree.img").write_bytes(magic + record({1: 31227, 2: 0, 3: 31227, 4: 31227}))
    (tmp_path / "tty-info.img").write_bytes(
        magic + record({1: 0, 2: 1, 6: tty_sid, 7: tty_sid, 8: rdev}))
    assert images_hold_shell_terminal(tmp_path) is expected


def test_images_without_terminals_or_unreadable_need_no_leader(tmp_path: Path) -> None:
    (tmp_path / "pstree.img").write_bytes(b"\0" * 8 + record({1: 7, 4: 3}))
    assert images_hold_shell_terminal(tmp_path) is False  # no tty-info.img
    (tmp_path / "tty-info.img").write_bytes(b"\0" * 8 + b"\xff\xff")  # cut short
    assert images_hold_shell_terminal(tmp_path) is False


def test_frames_arrive_in_pieces_and_oversized_ones_are_refused() -> None:
    stream = frame(OUTPUT, b"hello") + json_frame(STATE, {"terminal": True}) + frame(INPUT, b"")
    reader = FrameReader()
    got = []
    for i in range(len(stream)):
        got += reader.feed(stream[i:i + 1])
    assert got == [(OUTPUT, b"hello"), (STATE, b'{"terminal": true}'), (INPUT, b"")]
    with pytest.raises(ValueError):
        FrameReader().feed(b"o" + struct.pack(">I", 1 << 30))


def test_job_state_from_a_holder_is_checked_field_by_field() -> None:
    state = JobState(terminal=True, pinned="20260101-000000-1-abcd", status=3)
    assert JobState.from_dict(state.as_dict()) == state
    hostile = JobState.from_dict({"terminal": "yes", "status": True, "signal": "9",
                                  "pinned": "", "ended": 1})
    assert hostile == JobState()
    assert describe_end(JobState(ended=True, status=3)) == "exited with status 3"
    assert describe_end(JobState(ended=True, signal=signal.SIGTERM)) == "killed by SIGTERM"
    assert describe_end(JobState(ended=True)) == "ended"
    assert shell_status(JobState(signal=9)) == 137 and shell_status(JobState(status=3)) == 3


def test_a_holders_view_of_its_pty() -> None:
    """A session leader on a real pty: its foreground group and session read off the master;
    a child that waits in select(2) is seen waiting, one stopped shows state T."""
    master, slave = os.openpty()
    pid = os.fork()
    if pid == 0:  # the session's leader, waiting in select on its terminal
        try:
            os.setsid()
            import fcntl
            import select
            import termios

            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
            select.select([slave], [], [], 30)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while session_of(master) != pid and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session_of(master) == pid and foreground_of(master) == pid
        assert waiting_in_poll([pid], looks=200)
        os.kill(pid, signal.SIGSTOP)
        while proc_state(pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_state(pid) == "T"
        assert not waiting_in_poll([pid], looks=1)  # stopped: not waiting for anything
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(master)
        os.close(slave)
    lone, lone_slave = os.openpty()  # a pty no session has as its terminal
    try:
        assert session_of(lone) is None
    finally:
        os.close(lone)
        os.close(lone_slave)


def test_attach_to_a_checkpointed_shell_job_says_how_to_bring_it_back() -> None:
    from oomguard.terminal.client import HolderError
    from oomguard.terminal.commands import attach, holder_of_checkpoint

    checkpoint = "20261203-150303-6046-044c"
    meta = {"id": checkpoint, "state": "checkpointed",
            "extra": {"shell_tty": {"key": "tty[8801:1a]", "index": 1, "socket": None}}}
    with pytest.raises(HolderError, match=f"is not running: `oomguard restore {checkpoint}`"):
        attach(checkpoint, lambda _method, **_params: {"checkpoint": meta})
    # Once restored, its new terminal's holder is the one to attach to.
    restored = {**meta, "state": "restored",
                "extra": {"shell_tty": {"key": None, "socket": "/run/oomguard/tty/0/t.sock"}}}
    assert holder_of_checkpoint(restored) == "/run/oomguard/tty/0/t.sock"


def test_the_leader_continues_the_restored_tree_but_the_tasks_the_user_stopped() -> None:
    """A restored tree comes back stopped; its leader continues it once it has the terminal
    (the restorer would too, but it may have been killed), leaving the user's stops."""
    import subprocess

    from oomguard.terminal.jobprocs import descendants
    from oomguard.terminal.leader import continue_job, keep_stopped
    from tests.helpers import wait_until

    root = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        assert wait_until(lambda: len(descendants(root.pid)) == 2, 10)
        first, second = sorted(descendants(root.pid))
        for pid in (root.pid, first, second):
            os.kill(pid, signal.SIGSTOP)
        assert wait_until(lambda: all(proc_state(p) == "T" for p in (root.pid, first, second)),
                          10)
        assert keep_stopped(f"{second},x,") == {second}
        continue_job(root.pid, keep_stopped(str(second)))
        assert wait_until(lambda: proc_state(root.pid) == "S" and proc_state(first) == "S", 10)
        assert proc_state(second) == "T"
    finally:
        for pid in descendants(root.pid):
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()
