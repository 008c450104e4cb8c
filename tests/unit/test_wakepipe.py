"""oomguard.model.wakepipe: the one self-pipe (issue 30 item 5)."""

from __future__ import annotations

import fcntl
import os
import select
import signal

from oomguard.model.wakepipe import WakePipe


def test_a_wake_up_makes_the_read_end_ready_until_drained() -> None:
    pipe = WakePipe()
    try:
        for fd in (pipe.read_fd, pipe.write_fd):
            assert not os.get_blocking(fd) and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert select.select([pipe], [], [], 0)[0] == []
        assert pipe.drain() == b""  # nothing pending: no error
        pipe.wake(b"r")
        pipe.wake()
        assert select.select([pipe], [], [], 0)[0] == [pipe]
        assert pipe.drain() == b"rw"
        assert select.select([pipe], [], [], 0)[0] == []
    finally:
        pipe.close()


def test_a_full_pipe_and_a_closed_one_are_no_error() -> None:
    pipe = WakePipe()
    while True:
        try:
            os.write(pipe.write_fd, b"x" * 65536)
        except BlockingIOError:
            break
    pipe.wake()  # full: a wake-up is pending anyway
    pipe.close()
    pipe.close()  # once only: never a reused fd
    assert pipe.read_fd == pipe.write_fd == -1
    pipe.wake()
    assert pipe.drain() == b""


def test_it_carries_signal_numbers_for_set_wakeup_fd() -> None:
    pipe = WakePipe()
    old_handler = signal.signal(signal.SIGUSR1, lambda *_: None)
    old_fd = signal.set_wakeup_fd(pipe.write_fd, warn_on_full_buffer=False)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert pipe.drain() == bytes([signal.SIGUSR1])
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR1, old_handler)
        pipe.close()
