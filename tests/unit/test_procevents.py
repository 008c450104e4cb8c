"""oomguard.sense.procevents: cn_proc datagrams laid out as the kernel sends them, decoded by
pyroute2's real marshal; the subscription against a fake kernel (ack, errno, silence,
ENOBUFS) and against the real one; pyroute2 loaded lazily, without its package __init__."""

from __future__ import annotations

import errno
import gc
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from oomguard.sense.cnproc import (
    EXITS,
    FORKS,
    PROC_CN_MCAST_IGNORE,
    PROC_CN_MCAST_LISTEN,
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    ControlAck,
    ProcessExec,
    ProcessExit,
    ProcessFork,
    control_message,
    load_cn_proc,
    parse_events,
    parse_messages,
)
from oomguard.sense.procevents import EventBatch, ProcEvents, Subscriber, unavailable
from tests.helpers import REPO

PROC_EVENT_COMM = 0x200
PROC_EVENT_NONE = 0


# -- datagrams in kernel layout (include/uapi/linux/cn_proc.h, connector.h, netlink.h) --------

def datagram(what: int, payload: bytes, *, stamp: int = 5, seq: int = 9, ack: int = 0,
             cpu: int = 1) -> bytes:
    """One message as cn_netlink_send() lays it out: nlmsghdr (type NLMSG_DONE), cn_msg
    {idx CN_IDX_PROC, val CN_VAL_PROC, seq, ack, len}, then struct proc_event, whose union is
    24 bytes whatever the event (the comm event's is the largest)."""
    event = struct.pack("=IIQ", what, cpu, stamp) + payload.ljust(24, b"\0")
    cn = struct.pack("=IIIIHH", 1, 1, seq, ack, len(event), 0) + event
    return struct.pack("=IHHII", 16 + len(cn), 3, 0, seq, 0) + cn


def fork_datagram(parent: int, child: int, *, parent_pid: int | None = None,
                  child_pid: int | None = None, stamp: int = 5) -> bytes:
    return datagram(PROC_EVENT_FORK, struct.pack(
        "=IIII", parent_pid or parent, parent, child_pid or child, child), stamp=stamp)


def exit_datagram(pid: int, tgid: int, status: int, stamp: int = 5) -> bytes:
    # exit_code (the wait status), exit_signal, parent_pid, parent_tgid
    return datagram(PROC_EVENT_EXIT, struct.pack("=IIIIII", pid, tgid, status, 17, 1, 1),
                    stamp=stamp)


def ack_datagram(ack: int, err: int = 0) -> bytes:
    return datagram(PROC_EVENT_NONE, struct.pack("=I", err), ack=ack, cpu=0xFFFFFFFF)


def test_fork_exec_and_exit_through_pyroute2s_marshal() -> None:
    assert parse_events(fork_datagram(100, 101, stamp=7)) == [ProcessFork(100, 100, 101, 101, 7)]
    thread = fork_datagram(100, 100, parent_pid=100, child_pid=102)
    assert parse_events(thread) == [ProcessFork(100, 100, 102, 100, 5)]
    assert not parse_events(thread)[0].new_process  # type: ignore[union-attr]
    assert parse_events(datagram(PROC_EVENT_EXEC, struct.pack("=II", 103, 103), stamp=8)) == [
        ProcessExec(103, 103, 8)]
    assert parse_events(exit_datagram(77, 77, 3 << 8, stamp=123)) == [
        ProcessExit(77, 77, 768, 123)]


def test_acks_other_events_and_several_messages() -> None:
    assert parse_messages(ack_datagram(42, errno.EPERM)) == [ControlAck(42, errno.EPERM)]
    assert parse_events(ack_datagram(42)) == []
    assert parse_events(datagram(PROC_EVENT_COMM, struct.pack("=II16s", 5, 5, b"x"))) == []
    both = exit_datagram(5, 5, 9) + exit_datagram(6, 5, 0)
    assert [(e.pid, e.tgid) for e in parse_events(both)] == [(5, 5), (6, 5)]  # type: ignore[union-attr]


@pytest.mark.parametrize("raw", [
    b"",
    exit_datagram(5, 5, 9)[:30],  # cut inside cn_msg
    exit_datagram(5, 5, 9)[:60],  # cut inside the event: its length says more than is there
    struct.pack("=IHHII", 8, 3, 0, 0, 0) + b"\0" * 60,  # a length under the header's
    struct.pack("=IHHII", 36, 3, 0, 0, 0) + struct.pack("=IIIIHH", 1, 1, 0, 0, 0, 0),  # no event
    b"\xff" * 76,
])
def test_malformed_datagrams_yield_nothing(raw: bytes) -> None:
    assert parse_events(raw) == []


def test_a_malformed_message_does_not_hide_the_next() -> None:
    short = struct.pack("=IHHII", 40, 3, 0, 0, 0) + struct.pack("=IIIIHH", 1, 1, 0, 0, 0, 0)
    short += struct.pack("=I", PROC_EVENT_EXIT)  # claims an exit, 4 bytes of it
    assert parse_events(short + exit_datagram(8, 8, 0)) == [ProcessExit(8, 8, 0, 5)]


@pytest.mark.parametrize(("status", "code", "sig"),
                         [(3 << 8, 3, None), (0, 0, None), (9, None, 9), (0x80 | 11, None, 11)])
def test_exit_status(status: int, code: int | None, sig: int | None) -> None:
    assert (ProcessExit(1, 1, status).exit_code, ProcessExit(1, 1, status).signal) == (code, sig)


def test_control_message_layout() -> None:
    raw = control_message(PROC_CN_MCAST_IGNORE, ack=4242)
    length, kind, flags, _seq, _pid = struct.unpack_from("=IHHII", raw)
    assert (length, kind, flags) == (len(raw), 3, 0) and len(raw) == 16 + 20 + 4
    assert struct.unpack_from("=IIIIHH", raw, 16) == (1, 1, 0, 4242, 4, 0)
    assert struct.unpack_from("=I", raw, 36) == (PROC_CN_MCAST_IGNORE,)


@pytest.mark.parametrize("ack", [0, 1, 4242, 0x7FFFFFFF, 0xFFFFFFFF])
@pytest.mark.parametrize("op", [PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE])
def test_control_message_is_pyroute2s_own_encoding(op: int, ack: int) -> None:
    """The template with its ack put in place is byte for byte what pyroute2 encodes."""
    msg = load_cn_proc().proc_event_control()
    msg["header"]["type"], msg["header"]["flags"] = 3, 0
    msg["header"]["sequence_number"], msg["header"]["pid"] = 0, 0
    msg["idx"], msg["val"], msg["seq"], msg["ack"], msg["len"] = 1, 1, 0, ack, 4
    msg["action"] = op
    msg.encode()
    assert control_message(op, ack) == bytes(msg.data)


@pytest.mark.parametrize(("code", "words"), [
    (errno.EPERM, "EPERM: no CAP_NET_ADMIN"),
    (errno.ECONNREFUSED, "ECONNREFUSED: not in the initial network namespace (a container?)"),
    (errno.ETIMEDOUT, "ETIMEDOUT: no answer: not in the initial PID and user namespaces, or a "
                      "kernel without CONFIG_PROC_EVENTS"),
    (errno.ENOSPC, "ENOSPC: No space left on device"),
])
def test_unavailable_in_words(code: int, words: str) -> None:
    assert unavailable(OSError(code, os.strerror(code))) == words


# -- the subscription, against a fake kernel ------------------------------------------------

class FakeKernel:
    """A datagram socketpair: ProcEvents holds one end; what the "kernel" sends arrives there.
    A LISTEN is answered with `answer` (an errno; None: no answer), after `before`."""

    def __init__(self, answer: int | None = 0, before: list[bytes] | None = None) -> None:
        self.ours, self.kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ours.setblocking(False)
        self.answer = answer
        self.before = before or []
        self.controls: list[tuple[int, int]] = []  # (op, ack) received
        self.overflow = 0  # recv raises ENOBUFS this many times first

    def open(self) -> socket.socket:
        return self  # type: ignore[return-value]

    def fileno(self) -> int:
        return self.ours.fileno()

    def send(self, data: bytes) -> int:
        ack = struct.unpack_from("=I", data, 28)[0]
        op = struct.unpack_from("=I", data, 36)[0]
        self.controls.append((op, ack))
        if op == PROC_CN_MCAST_LISTEN:
            for early in self.before:
                self.kernel.send(early)
            self.kernel.send(ack_datagram(ack + 1000))  # another listener's answer
            if self.answer is not None:
                self.kernel.send(ack_datagram(ack + 1, self.answer))
        return len(data)

    def recv(self, size: int) -> bytes:
        if self.overflow:
            self.overflow -= 1
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self.ours.recv(size)

    def close(self) -> None:
        self.ours.close()


def test_events_before_the_answer_are_kept_and_close_says_ignore() -> None:
    kernel = FakeKernel(before=[fork_datagram(1, 50)])
    events = ProcEvents(open_socket=kernel.open)
    kernel.kernel.send(exit_datagram(50, 50, 0))
    batch = events.read()
    assert batch.events == (ProcessFork(1, 1, 50, 50, 5), ProcessExit(50, 50, 0, 5))
    assert batch.lost == 0
    assert events.read().events == ()  # nothing queued: no wait either
    events.close()
    events.close()
    (listen, ack), (ignore, ack_again) = kernel.controls
    assert (listen, ignore) == (PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE) and ack == ack_again
    assert kernel.ours.fileno() == -1


def test_the_kernels_errno_is_raised_and_the_socket_closed() -> None:
    kernel = FakeKernel(answer=errno.EPERM)
    with pytest.raises(OSError) as refused:
        ProcEvents(open_socket=kernel.open)
    assert refused.value.errno == errno.EPERM and kernel.ours.fileno() == -1


def test_no_answer_is_etimedout() -> None:
    kernel = FakeKernel(answer=None)
    with pytest.raises(OSError) as silent:
        ProcEvents(open_socket=kernel.open, ack_timeout=0.05)
    assert silent.value.errno == errno.ETIMEDOUT and kernel.ours.fileno() == -1


def test_enobufs_is_reported_and_what_follows_still_read() -> None:
    kernel = FakeKernel()
    events = ProcEvents(open_socket=kernel.open)
    kernel.kernel.send(fork_datagram(1, 60))
    kernel.overflow = 1
    batch = events.read()
    assert batch.lost == 1 and batch.events == (ProcessFork(1, 1, 60, 60, 5),)
    assert events.read().lost == 0
    events.close()


def test_the_subscriber_remembers_a_lasting_reason_only() -> None:
    calls: list[int] = []

    def refuse(code: int) -> ProcEvents:
        calls.append(code)
        raise OSError(code, os.strerror(code))

    flaky = Subscriber(lambda: refuse(errno.EMFILE))
    assert flaky.open() is None and flaky.open() is None and calls == [errno.EMFILE] * 2
    assert flaky.why_not is None and flaky.last_error == "EMFILE: too many open files"
    calls.clear()
    lasting = Subscriber(lambda: refuse(errno.ECONNREFUSED))
    assert lasting.probe() is not None and lasting.open() is None and calls == [errno.ECONNREFUSED]
    assert lasting.why_not is not None and lasting.why_not.startswith("ECONNREFUSED")


# -- the real connector -----------------------------------------------------------------------

def real_events() -> ProcEvents:
    try:
        return ProcEvents()
    except OSError as exc:
        pytest.skip(f"process-event connector unavailable here: {unavailable(exc)}")


def test_the_kernel_reports_a_fork_and_its_exit_status() -> None:
    events = real_events()
    try:
        child = os.fork()
        if child == 0:
            os._exit(3)
        os.waitpid(child, 0)
        seen: list[ProcessFork | ProcessExec | ProcessExit] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                isinstance(e, ProcessExit) and e.tgid == child for e in seen):
            seen += events.read().events
            time.sleep(0.01)
    finally:
        events.close()
    forks = [e for e in seen if isinstance(e, ProcessFork) and e.child_tgid == child]
    exits = [e for e in seen if isinstance(e, ProcessExit) and e.tgid == child]
    assert [(f.parent_tgid, f.new_process) for f in forks] == [(os.getpid(), True)]
    assert [(e.exit_code, e.signal) for e in exits] == [(3, None)]
    assert forks[0].timestamp_ns <= exits[0].timestamp_ns <= time.monotonic_ns()


# -- pyroute2 loaded lazily, in a fresh interpreter each -------------------------------------

def fresh(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


CHECK = f"""
    parsed = parse_events(bytes.fromhex({fork_datagram(100, 101).hex()!r}))
    assert [e.child_tgid for e in parsed] == [101], parsed
    full = hasattr(sys.modules["pyroute2"], "IPRoute")  # set only by pyroute2/__init__.py
    print(full, "pyroute2.iproute" in sys.modules)
"""


def test_importing_oomguard_imports_no_pyroute2() -> None:
    assert fresh("""
        import sys
        import oomguard.lifecycle.exitwatch, oomguard.act.freezer, oomguard.daemon.serve, oomguard.cli.doctor
        import oomguard.sense.procevents
        print("pyroute2" in sys.modules)
    """) == "False"


def test_the_connector_modules_load_without_pyroute2s_init() -> None:
    assert fresh("import sys\nfrom oomguard.sense.cnproc import parse_events\n"
                 + textwrap.dedent(CHECK)) == "False False"


@pytest.mark.parametrize("find_spec", [
    "lambda name: None",  # not found that way
    "lambda name: importlib.util.find_spec('json')",  # a package without the connector in it
])
def test_the_plain_import_when_the_light_one_fails(find_spec: str) -> None:
    assert fresh(textwrap.dedent(f"""
        import importlib.util, sys
        from oomguard.sense import procevents
        from oomguard.sense.cnproc import parse_events
        procevents.load_cn_proc(find_spec={find_spec})
    """) + textwrap.dedent(CHECK)) == "True True"


def test_a_pyroute2_imported_already_is_used_as_it_is() -> None:
    assert fresh("import sys, pyroute2\nfrom oomguard.sense.cnproc import parse_events\n"
                 + textwrap.dedent(CHECK)) == "True True"


def test_the_light_import_costs_a_fraction_of_the_whole() -> None:
    """RSS added beside oomguard's own imports (measured: +1.1 MiB against +9.8 MiB)."""
    measure = """
        import sys
        import oomguard.daemon.serve
        from oomguard.sense import procevents
        def rss():
            return int(next(l for l in open("/proc/self/status")
                            if l.startswith("VmRSS")).split()[1])
        before = rss()
        {load}
        print(rss() - before)
    """
    light = int(fresh(measure.format(load="procevents.load_cn_proc()")))
    whole = int(fresh(measure.format(load="procevents.load_cn_proc(find_spec=lambda n: None)")))
    assert light < 4096 < whole, (light, whole)


def test_a_subscription_dropped_unclosed_still_says_ignore() -> None:
    """An exception between a freeze and its wait drops the Frozen: the kernel is told."""
    kernel = FakeKernel()
    events = ProcEvents(open_socket=kernel.open)
    del events
    gc.collect()
    assert [op for op, _ack in kernel.controls] == [PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE]


def test_without_pyroute2_the_connector_is_unavailable_not_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from oomguard.sense import procevents

    def missing() -> None:
        raise ImportError("No module named 'pyroute2'")

    monkeypatch.setattr(procevents, "load_cn_proc", missing)
    subscriber = Subscriber()
    assert subscriber.probe() == "ENOPKG: pyroute2 is not installed (pip install pyroute2)"
    assert subscriber.why_not is not None and subscriber.open() is None


def test_a_failing_socket_reads_as_events_lost() -> None:
    kernel = FakeKernel()
    events = ProcEvents(open_socket=kernel.open)
    kernel.ours.close()  # EBADF from here on
    assert events.read() == EventBatch((), 1)
    events.close()


def test_kinds_not_asked_for_are_skipped_before_the_marshal() -> None:
    forks_and_exits = fork_datagram(1, 70) + exit_datagram(70, 70, 0) + datagram(
        PROC_EVENT_EXEC, struct.pack("=II", 71, 71))
    assert parse_events(forks_and_exits, FORKS) == [ProcessFork(1, 1, 70, 70, 5)]
    assert parse_events(forks_and_exits, EXITS) == [ProcessExit(70, 70, 0, 5)]
    assert len(parse_events(forks_and_exits)) == 3
    kernel = FakeKernel(before=[fork_datagram(1, 72)])  # the answer still comes through
    events = ProcEvents(kinds=EXITS, open_socket=kernel.open)
    kernel.kernel.send(exit_datagram(72, 72, 1 << 8))
    assert events.read().events == (ProcessExit(72, 72, 256, 5),)
    events.close()
