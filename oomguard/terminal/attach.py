"""The attach client: shows a job's terminal (its pty holder) on the user's terminal, for
`oomguard attach`, `oomguard exec` and `oomguard restore`, and behaves as a shell's
foreground job does:

- the user's keys go to the job only while the job has its terminal (it asked for input or set
  the terminal's modes: the holder says so) and this client is in the foreground of the user's
  terminal; then the user's terminal is in raw mode (Ctrl-\\ detaches, as in dtach). Otherwise
  the user's terminal is left as it is and not read: lines typed or pasted after the command
  stay for the user's shell. Ctrl-C then interrupts the job, Ctrl-\\ detaches;
- Ctrl-Z stops the job and this client with it (the shell prints "Stopped"); `fg` continues
  both, `bg` the job alone (its output still shows);
- when the job ends, the client ends at once, with the job's exit status.

Holders from before the frames (oomguard/terminal/wire.py) get the old raw relay."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import termios
import tty
from collections.abc import Callable
from typing import Any

from oomguard.terminal.userterm import (
    TypedLines,
    can_suspend,
    in_foreground,
    pending_input,
    signal_wakeups,
    window_size,
    write_all,
)
from oomguard.terminal.wire import (
    CONTROL,
    INPUT,
    OUTPUT,
    STATE,
    FrameReader,
    JobState,
    frame,
    window_frame,
)

DETACH_KEY = b"\x1c"  # Ctrl-\
ENDED, DETACHED, HANGUP, PINNED, GONE = "ended", "detached", "hangup", "pinned", "gone"
ASK_AGAIN = 0.5  # while a typed line waits and the job has not taken the terminal
CLIENT_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT,
                  signal.SIGTSTP, signal.SIGCONT, signal.SIGWINCH)


class JobClient:
    """One attached session. `run` returns why it stopped: ENDED (the job is over: `state`
    says how), PINNED (it was checkpointed: state.pinned), DETACHED (Ctrl-\\), HANGUP (the
    user's terminal is gone), GONE (the holder closed without a word), or what `on_signal`
    returned. `on_signal(sig)` sees the signals it asks for first (`oomguard exec` forwards
    some to the job's init, and learns of its exit from SIGCHLD); returning "" means handled."""

    def __init__(self, sock: socket.socket, info: dict[str, Any], stdin_fd: int | None,
                 out_fd: int, wake_fd: int,
                 on_signal: Callable[[int], str | None] | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.sock = sock
        self.framed = info.get("frames") is True
        self.state = JobState.from_dict(info.get("state") or {}) if self.framed \
            else JobState(terminal=True)
        self.stdin_fd = stdin_fd if stdin_fd is not None and os.isatty(stdin_fd) else None
        self.out_fd = out_fd
        self.wake_fd = wake_fd
        self.on_signal = on_signal or (lambda _sig: None)
        self.say = say or (lambda text: print(f"\r\noomguard: {text}", file=sys.stderr,
                                              flush=True))
        self.reader = FrameReader()
        self.saved: list[Any] | None = None  # the user's terminal modes while raw
        self.sel = selectors.DefaultSelector()
        self.stopping = False  # we asked the job to stop (Ctrl-Z while not relaying)
        self.typed: TypedLines | None = None  # lines typed while the job does not read

    # -- the user's terminal -------------------------------------------------------------------

    def relaying(self) -> bool:
        return self.saved is not None

    def should_relay(self) -> bool:
        return (self.stdin_fd is not None and self.state.terminal and not self.state.stopped
                and in_foreground(self.stdin_fd))

    def settle_mode(self) -> None:
        """Raw and reading while the job has its terminal and we are in the foreground;
        otherwise the user's terminal as it was, not read."""
        if self.should_relay() and not self.relaying():
            assert self.stdin_fd is not None
            try:
                self.saved = termios.tcgetattr(self.stdin_fd)
                tty.setraw(self.stdin_fd, termios.TCSANOW)  # not TCSAFLUSH: keep typed input
            except (OSError, termios.error):
                self.saved = None
                return
            self.sel.register(self.stdin_fd, selectors.EVENT_READ, "stdin")
            self.send_window_size()
        elif not self.should_relay() and self.relaying():
            self.restore_mode()
        self.watch_typing(not self.relaying() and self.stdin_fd is not None
                          and not self.state.terminal and not self.state.stopped
                          and in_foreground(self.stdin_fd))

    def watch_typing(self, wanted: bool) -> None:
        if wanted and self.typed is None and self.stdin_fd is not None:
            self.typed = TypedLines(self.stdin_fd)
            self.sel.register(self.typed, selectors.EVENT_READ, "typed")
        elif not wanted and self.typed is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(self.typed)
            self.typed.close()
            self.typed = None

    def restore_mode(self) -> None:
        if self.saved is None or self.stdin_fd is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.stdin_fd)
        with contextlib.suppress(OSError, termios.error):
            termios.tcsetattr(self.stdin_fd, termios.TCSADRAIN, self.saved)
        self.saved = None

    def send_window_size(self) -> None:
        size = window_size(self.stdin_fd if self.stdin_fd is not None else self.out_fd)
        if size is not None:
            with contextlib.suppress(OSError):
                self.sock.sendall(window_frame(*size))

    def control(self, op: str, **fields: Any) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(frame(CONTROL, json.dumps({"op": op, **fields}).encode()))

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> str:
        self.sel.register(self.sock, selectors.EVENT_READ, "holder")
        self.sel.register(self.wake_fd, selectors.EVENT_READ, "wake")
        try:
            if self.state.stopped and in_foreground(self.stdin_fd):
                self.control("cont")  # attaching brings a stopped job back, as `fg` does
            why = self.verdict()
            if why is not None:
                return why
            self.settle_mode()
            if not self.relaying():
                self.send_window_size()
            while True:
                events = self.sel.select(ASK_AGAIN if self.typed_waiting() else None)
                if not events and self.typed_waiting():
                    self.control("want")  # the job may wait for input in select(2) by now
                for key, _ in events:
                    why = self.step(key.data)
                    if why is not None:
                        return why
        finally:
            self.restore_mode()
            self.watch_typing(False)
            self.sel.close()

    def typed_waiting(self) -> bool:
        """A line typed for a job that has not taken its terminal waits in ours."""
        return (self.typed is not None and self.typed.asked and not self.state.terminal
                and self.stdin_fd is not None and pending_input(self.stdin_fd) > 0)

    def verdict(self) -> str | None:
        if self.state.pinned:
            return PINNED
        if self.state.ended:
            return ENDED
        return None

    def step(self, source: str) -> str | None:
        if source == "holder":
            return self.from_holder()
        if source == "stdin":
            return self.from_user()
        if source == "typed":
            if self.typed is not None and self.typed.new_line():
                self.typed.asked = True
                self.control("want")  # a line typed for a job that has not read yet
            return None
        return self.signals()

    def from_holder(self) -> str | None:
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            return GONE
        if not self.framed:
            return self.show(data)
        try:
            frames = self.reader.feed(data)
        except ValueError:
            return GONE
        for kind, payload in frames:
            if kind == OUTPUT:
                why = self.show(payload)
                if why is not None:
                    return why
            elif kind == STATE:
                with contextlib.suppress(ValueError):
                    self.state = JobState.from_dict(json.loads(payload))
                why = self.verdict()
                if why is not None:
                    return why
                if self.state.stopped:
                    self.suspend()
                self.settle_mode()
        return None

    def show(self, data: bytes) -> str | None:
        try:
            write_all(self.out_fd, data)
        except OSError:
            return HANGUP
        return None

    def from_user(self) -> str | None:
        assert self.stdin_fd is not None
        try:
            data = os.read(self.stdin_fd, 4096)
        except OSError:
            data = b""
        if not data:
            return HANGUP
        detach = DETACH_KEY in data
        if detach:
            data = data[:data.index(DETACH_KEY)]
        if data:
            try:
                self.sock.sendall(frame(INPUT, data))
            except OSError:
                return GONE
        return DETACHED if detach else None

    def signals(self) -> str | None:
        try:
            caught = os.read(self.wake_fd, 64)
        except BlockingIOError:
            return None
        for sig in caught:
            answer = self.on_signal(sig)
            if answer:
                return answer
            if answer == "":
                continue
            why = self.own_signal(sig)
            if why is not None:
                return why
        return None

    def own_signal(self, sig: int) -> str | None:
        if sig == signal.SIGWINCH:
            self.send_window_size()
        elif sig == signal.SIGCONT:  # `fg` or `bg` after a stop of our own
            self.settle_mode()
        elif sig == signal.SIGHUP:
            return HANGUP
        elif sig in (signal.SIGTERM, signal.SIGQUIT):  # SIGQUIT: Ctrl-\ while not raw
            return DETACHED
        elif sig == signal.SIGINT:  # Ctrl-C while the user's terminal is not raw
            self.control("signal", signal=int(signal.SIGINT))
        elif sig == signal.SIGTSTP:  # Ctrl-Z while the user's terminal is not raw
            self.stopping = True
            self.control("stop")
        return None

    def drain(self) -> None:
        """Show everything the holder still sends, until it closes."""
        with contextlib.suppress(OSError):
            self.sock.settimeout(5.0)
            while self.from_holder() is None:
                pass

    def suspend(self) -> None:
        """The job stopped (Ctrl-Z): stop with it, as a shell's job; when continued (`fg`,
        `bg`), continue the job."""
        self.stopping = False
        self.restore_mode()
        if not can_suspend(self.stdin_fd if self.stdin_fd is not None else self.out_fd):
            # No shell here could continue us (we are not its foreground job): the job goes
            # on, as under a shell without job control.
            self.say("the job was stopped; no shell here does job control: it goes on")
            self.control("cont")
            return
        if os.isatty(2):
            with contextlib.suppress(OSError):
                os.write(2, b"\r\n")  # after the ^Z the terminal echoed
        self.say("the job is stopped; `fg` continues it")
        previous = signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), signal.SIGTSTP)  # the shell takes the terminal back
        finally:
            signal.signal(signal.SIGTSTP, previous)
        self.control("cont")


def attach_session(sock: socket.socket, info: dict[str, Any], stdin_fd: int | None,
                   out_fd: int, on_signal: Callable[[int], str | None] | None = None,
                   extra_signals: tuple[int, ...] = ()) -> tuple[str, JobClient]:
    """Run one attached session with the user's terminal; (why it ended, the client)."""
    with signal_wakeups((*CLIENT_SIGNALS, *extra_signals)) as wake:
        client = JobClient(sock, info, stdin_fd, out_fd, wake, on_signal)
        return client.run(), client
