"""What the daemon asks of a socket named like a terminal holder is bounded in time: a socket
that accepts and then trickles its answer a byte at a time (never a whole line) is given up
on at the deadline, one request, one notification, many of them at once, a lookup among
many."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.terminal.client import (
    NOTIFY_DEADLINE,
    HolderError,
    new_socket_path,
    notify,
    notify_all,
    request,
)
from oomguard.terminal.shelljob import holder_serving


class Trickler:
    """A listening socket whose every connection is sent a byte each 0.1 s, no newline."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            while not self.stop.is_set():
                try:
                    conn.send(b" ")
                except OSError:
                    return
                time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


@pytest.fixture
def tricklers() -> Iterator[list[Trickler]]:
    directory = Path(tempfile.mkdtemp(prefix="ogc-", dir="/tmp"))
    made = [Trickler(new_socket_path(directory)) for _ in range(4)]
    yield made
    for trickler in made:
        trickler.close()
        trickler.path.unlink()
    directory.rmdir()


def _timed(call: object) -> tuple[object, float]:
    start = time.monotonic()
    result = call() if callable(call) else None
    return result, time.monotonic() - start


def test_a_trickled_answer_is_given_up_on_at_the_deadline(tricklers: list[Trickler]) -> None:
    path = tricklers[0].path
    start = time.monotonic()
    with pytest.raises(HolderError, match="did not answer in time"):
        request(path, "info", timeout=0.3)
    assert time.monotonic() - start < 0.3 + 0.3
    answered, took = _timed(lambda: notify(str(path), "dumping", id="x"))
    assert answered is False and took < NOTIFY_DEADLINE + 0.3


def test_many_trickling_holders_are_told_at_once_within_one_deadline(
        tricklers: list[Trickler]) -> None:
    paths = [str(t.path) for t in tricklers]
    answered, took = _timed(lambda: notify_all(paths, "pin", id="x"))
    assert answered == [] and took < NOTIFY_DEADLINE + 0.4


def test_a_lookup_among_trickling_sockets_ends_at_its_deadline(
        tricklers: list[Trickler]) -> None:
    found, took = _timed(lambda: holder_serving("tty[8800:1a]", tricklers[0].path.parent,
                                                deadline=0.8))
    assert found is None and took < 0.8 + 0.4
