"""oomguard.sense.psi: pressure files, the CAP_SYS_RESOURCE check, trigger strings and registration."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import types
from pathlib import Path
from typing import Any

import pytest

import oomguard.sense.psi as psi
from oomguard.model.pressure import Pressure, PressureLine, parse_pressure
from oomguard.sense.psi import (
    has_cap_sys_resource,
    open_trigger,
    shortest_window_us,
    trigger_string,
)

# -- parse_pressure ------------------------------------------------------------------------------

MEMORY_PRESSURE = (
    "some avg10=0.00 avg60=0.15 avg300=0.05 total=242241\n"
    "full avg10=1.25 avg60=0.10 avg300=0.03 total=198765\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MEMORY_PRESSURE,
         Pressure(some=PressureLine(0.0, 0.15, 0.05, 242241),
                  full=PressureLine(1.25, 0.10, 0.03, 198765))),
        # /proc/pressure/cpu before 5.13 (and some cgroup files): a 'some' line only
        ("some avg10=12.34 avg60=5.67 avg300=0.89 total=1234567890\n",
         Pressure(some=PressureLine(12.34, 5.67, 0.89, 1234567890), full=None)),
        # no trailing newline, 'full' first
        ("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\nsome avg10=0.00 avg60=0.00 avg300=0.00 total=7",
         Pressure(some=PressureLine(0.0, 0.0, 0.0, 7), full=PressureLine(0.0, 0.0, 0.0, 0))),
        # all-zero idle system; total far past 2**32
        ("some avg10=0.00 avg60=0.00 avg300=0.00 total=18446744073709\n"
         "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
         Pressure(some=PressureLine(0.0, 0.0, 0.0, 18446744073709), full=PressureLine(0, 0, 0, 0))),
        # fields in a different order still parse (key=value, not positional)
        ("some total=5 avg300=0.30 avg60=0.60 avg10=0.10\n",
         Pressure(some=PressureLine(0.10, 0.60, 0.30, 5), full=None)),
    ],
    ids=["some+full", "some-only", "full-first-no-newline", "idle-big-total", "reordered"],
)
def test_parse_pressure(text: str, expected: Pressure) -> None:
    got = parse_pressure(text)
    assert got == expected
    assert isinstance(got.some.total_us, int)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",  # no 'some' line
        "some avg10=0.00 avg60=0.15 avg300=0.05\n",  # no total
        "some avg60=0.15 avg300=0.05 total=1\n",  # no avg10
        "some avg10=abc avg60=0.15 avg300=0.05 total=1\n",  # not a number
        "some avg10=0.00 avg60=0.15 avg300=0.05 total=1.5\n",  # total must be an integer
        "some avg10=0.00 avg60 avg300=0.05 total=1\n",  # an item without '='
        "some\n",
        MEMORY_PRESSURE + "full avg10=0.00 avg60=0.00 avg300=0.00\n",  # a later line broken
    ],
    ids=["empty", "blank", "full-only", "no-total", "no-avg10", "nan-text", "float-total",
         "no-equals", "bare-kind", "broken-later-line"],
)
def test_parse_pressure_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_pressure(text)


def test_parse_pressure_message_names_the_line() -> None:
    with pytest.raises(ValueError, match=re.escape("malformed pressure line: 'some avg10=0.00'")):
        parse_pressure("some avg10=0.00\n")
    with pytest.raises(ValueError, match="no 'some' line"):
        parse_pressure("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


@pytest.mark.skipif(not Path("/proc/pressure/memory").exists(), reason="kernel without PSI")
def test_parse_pressure_on_this_host() -> None:
    p = parse_pressure(Path("/proc/pressure/memory").read_text())
    assert p.full is not None  # memory always has a 'full' line
    assert p.some.total_us >= p.full.total_us >= 0


# -- has_cap_sys_resource ------------------------------------------------------------------------

def _status(cap_eff: str | None, cap_prm: str = "000001ffffffffff") -> str:
    lines = ["Name:\toomguard", "State:\tS (sleeping)", "Pid:\t4242", "Uid:\t0\t0\t0\t0",
             "CapInh:\t0000000000000000", f"CapPrm:\t{cap_prm}"]
    if cap_eff is not None:
        lines.append(f"CapEff:\t{cap_eff}")
    lines += ["CapBnd:\t000001ffffffffff", "CapAmb:\t0000000000000000", "NoNewPrivs:\t0",
              "Seccomp:\t0"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (_status("000001ffffffffff"), True),  # root: every capability
        (_status("000001fffeffffff"), False),  # root in a container that dropped CAP_SYS_RESOURCE
        (_status("0000000001000000"), True),  # CAP_SYS_RESOURCE (bit 24) alone
        (_status("0000000000ffffff"), False),  # bits 0-23 only
        (_status("0000000002000000"), False),  # bit 25 (CAP_SYS_TIME) only
        (_status("0000000000000000"), False),  # an ordinary user
        (_status("0000000000000000", cap_prm="000001ffffffffff"), False),  # permitted, not effective
        (_status(None), False),  # no CapEff line at all
        ("", False),
    ],
    ids=["all", "all-but-24", "only-24", "low-24-bits", "bit-25", "none", "prm-not-eff",
         "no-capeff", "empty"],
)
def test_has_cap_sys_resource(text: str, expected: bool) -> None:
    assert has_cap_sys_resource(text) is expected


def test_has_cap_sys_resource_reads_this_process() -> None:
    text = Path("/proc/self/status").read_text()
    cap_eff = next(line.split()[1] for line in text.splitlines() if line.startswith("CapEff:"))
    assert has_cap_sys_resource(text) is bool(int(cap_eff, 16) & (1 << 24))


# -- shortest_window_us / trigger_string ---------------------------------------------------------

@pytest.mark.parametrize(("privileged", "window"), [(True, 500_000), (False, 2_000_000)])
def test_shortest_window_us(privileged: bool, window: int) -> None:
    assert shortest_window_us(privileged) == window


@pytest.mark.parametrize(
    ("kind", "stall", "window", "expected"),
    [
        ("some", 50_000, 500_000, "some 50000 500000"),
        ("full", 150_000, 1_000_000, "full 150000 1000000"),
        ("some", 200_000, 2_000_000, "some 200000 2000000"),
        ("some", 2_000_000, 2_000_000, "some 2000000 2000000"),  # stall == window is allowed
        ("full", 1, 10_000_000, "full 1 10000000"),
    ],
)
def test_trigger_string(kind: str, stall: int, window: int, expected: str) -> None:
    assert trigger_string(kind, stall, window) == expected


@pytest.mark.parametrize(
    ("kind", "stall", "window", "match"),
    [
        ("other", 50_000, 500_000, "'some' or 'full'"),
        ("SOME", 50_000, 500_000, "'some' or 'full'"),
        ("", 50_000, 500_000, "'some' or 'full'"),
        ("some", 500_001, 500_000, "within the window"),  # stall > window
        ("some", 0, 500_000, "within the window"),
        ("full", -1, 500_000, "within the window"),
    ],
    ids=["other", "upper-case", "empty-kind", "stall-over-window", "stall-zero", "stall-negative"],
)
def test_trigger_string_rejects(kind: str, stall: int, window: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trigger_string(kind, stall, window)


# -- open_trigger --------------------------------------------------------------------------------

@pytest.mark.parametrize("trigger", ["some 50000 500000", "full 200000 2000000"])
def test_open_trigger_writes_trigger_and_nul(tmp_path: Path, trigger: str) -> None:
    path = tmp_path / "memory.pressure"
    path.write_bytes(b"")
    fd = open_trigger(path, trigger)
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert flags & os.O_ACCMODE == os.O_RDWR
        assert flags & os.O_NONBLOCK
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)
    assert path.read_bytes() == trigger.encode() + b"\0"


def test_open_trigger_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_trigger(tmp_path / "absent", "some 50000 500000")


class _OsWithFailingWrite(types.SimpleNamespace):
    """Stands in for `os` inside oomguard.sense.psi: the write fails like the kernel's, closes recorded."""

    def __init__(self, err: int) -> None:
        super().__init__(closed=[], opened=[])
        self._err = err

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, *args: Any, **kwargs: Any) -> int:
        fd = os.open(*args, **kwargs)
        self.opened.append(fd)
        return fd

    def write(self, fd: int, data: bytes) -> int:
        raise OSError(self._err, os.strerror(self._err))

    def close(self, fd: int) -> None:
        self.closed.append(fd)
        os.close(fd)


@pytest.mark.parametrize(
    ("err", "raised"),
    [(errno.EINVAL, ValueError), (errno.EBUSY, OSError), (errno.EPERM, OSError)],
    ids=["einval->ValueError", "ebusy-propagates", "eperm-propagates"],
)
def test_open_trigger_write_failure_closes_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              err: int, raised: type[Exception]) -> None:
    path = tmp_path / "memory.pressure"
    path.write_bytes(b"")
    fake = _OsWithFailingWrite(err)
    monkeypatch.setattr(psi, "os", fake)
    with pytest.raises(raised) as info:
        open_trigger(path, "some 50000 500000")
    assert fake.opened and fake.closed == fake.opened  # no fd leaked
    if raised is ValueError:
        assert "kernel refused PSI trigger 'some 50000 500000'" in str(info.value)
    else:
        assert not isinstance(info.value, ValueError)
        assert info.value.errno == err  # type: ignore[attr-defined]
