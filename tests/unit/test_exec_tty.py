"""The pure parts of terminal jobs: CRIU's external-tty keys, fd-table reading (kernel-format
fdinfo), the exec wrapper's argv and exit statuses, the namespace init's arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.act.criu import Criu
from oomguard.model.runner import CommandResult
from oomguard.terminal import nsinit
from oomguard.terminal.client import SYSTEM_DIR, runtime_dir
from oomguard.terminal.commands import holder_of_checkpoint
from oomguard.terminal.execwrap import NSINIT, exit_status, nsinit_argv
from oomguard.terminal.external import (
    SOCKET_ENV,
    ExternalTty,
    FdEntry,
    TtySensor,
    dump_args,
    environ_value,
    external_from,
    fdinfo_tty_index,
    format_key,
    inherit_args,
    parse_key,
    pts_index,
    stat_session_tty,
)
from tests.unit.test_criu_argv import FakeRunner

# Read on this kernel (6.18) from a process holding both ends of a pty.
PTMX_FDINFO = "pos:\t0\nflags:\t02100002\nmnt_id:\t24\nino:\t91\ntty-index:\t7\n"
PTS_FDINFO = "pos:\t0\nflags:\t02000002\nmnt_id:\t29\nino:\t3\n"


def test_key_is_criu_format_hex_without_prefix() -> None:
    assert format_key(0x8800, 0x1A) == "tty[8800:1a]"
    # st_rdev as stat(2) gives it (CRIU formats the same number): minors > 255 go high.
    assert format_key(os.makedev(136, 300), 0x19) == "tty[10882c:19]"
    assert parse_key("tty[8800:1a]") == (0x8800, 0x1A)
    assert parse_key(format_key(0x880F, 0xFE00000)) == (0x880F, 0xFE00000)


@pytest.mark.parametrize("bad", ["tty[8800]", "fd[3]:tty[1:2]", "tty[0x88:1a]", "TTY[1:2]",
                                 "tty[88:1g]", ""])
def test_malformed_keys_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a CRIU tty key"):
        parse_key(bad)


def test_dump_and_restore_arguments() -> None:
    ttys = [ExternalTty(0x8800, 0x1A, 0), ExternalTty(0x8803, 0x1A, 3)]
    assert dump_args(ttys) == ["--external", "tty[8800:1a]", "--external", "tty[8803:1a]"]
    assert inherit_args([(5, "tty[8800:1a]")]) == ["--inherit-fd", "fd[5]:tty[8800:1a]"]
    with pytest.raises(ValueError):
        inherit_args([(5, "fd[1]")])


@pytest.mark.parametrize(("link", "index"), [("/dev/pts/0", 0), ("/dev/pts/17", 17),
                                             ("/dev/ptmx", None), ("/dev/pts/ptmx", None),
                                             ("/dev/tty", None), ("/dev/pts/1 (deleted)", None),
                                             ("pipe:[123]", None)])
def test_pts_index(link: str, index: int | None) -> None:
    assert pts_index(link) == index


def test_fdinfo_tty_index_from_kernel_text() -> None:
    assert fdinfo_tty_index(PTMX_FDINFO) == 7
    assert fdinfo_tty_index(PTS_FDINFO) is None
    assert fdinfo_tty_index("") is None


def test_environ_value() -> None:
    raw = b"PATH=/bin\0OOMGUARD_TTY_SOCKET=/run/x/tty-1.sock\0A=b=c\0"
    assert environ_value(raw, SOCKET_ENV) == "/run/x/tty-1.sock"
    assert environ_value(raw, "A") == "b=c"
    assert environ_value(raw, "PAT") is None


def test_external_is_a_slave_whose_master_is_outside_the_tree() -> None:
    entries = [FdEntry("/dev/pts/3", 0x8803, 0x1A), FdEntry("/dev/pts/3", 0x8803, 0x1A),
               FdEntry("/dev/null"), FdEntry("/dev/pts/4", 0x8804, 0x1A),
               FdEntry("/dev/ptmx", master_index=4), FdEntry("/dev/ptmx", master_index=None)]
    assert external_from(entries, [0x8803], "/s") == [ExternalTty(0x8803, 0x1A, 3, "/s")]
    assert external_from([FdEntry("/dev/null")], [0x8803]) == []


def test_a_terminal_of_a_session_led_outside_the_tree_is_not_external() -> None:
    """A job started from an interactive shell: the shell leads the terminal's session; CRIU
    cannot restore that session from an inherited fd, so it stays a --shell-job terminal."""
    entries = [FdEntry("/dev/pts/3", 0x8803, 0x1A)]
    assert external_from(entries, []) == []
    assert external_from(entries, [0x8804]) == []


@pytest.mark.parametrize(("line", "expected"), [
    ("1234 (python3) S 1 1234 1234 34816 1234 4194560 0 0", (1234, 34816)),
    ("77 (a) b) (c d) R 1 70 70 0 -1 0", (70, 0)),
])
def test_stat_session_tty_with_hostile_names(line: str, expected: tuple[int, int]) -> None:
    assert stat_session_tty(line) == expected


def test_sensor_reads_fd_tables_from_a_proc_tree(tmp_path: Path) -> None:
    """A /proc fixture: pid 10 leads the session the pty controls, holds its slave (a real one,
    stat-able) and its environment names the holder; pid 11 holds a pipe. pid 12 is gone."""
    master, slave = os.openpty()
    try:
        for pid in (10, 11):
            (tmp_path / str(pid) / "fd").mkdir(parents=True)
            (tmp_path / str(pid) / "fdinfo").mkdir()
        slave_path = os.ttyname(slave)
        (tmp_path / "10" / "fd" / "0").symlink_to(slave_path)
        (tmp_path / "10" / "fd" / "1").symlink_to("/dev/null")
        (tmp_path / "10" / "environ").write_bytes(b"HOME=/\0OOMGUARD_TTY_SOCKET=/r/t.sock\0")
        (tmp_path / "11" / "fd" / "0").symlink_to("pipe:[42]")
        st = os.stat(slave_path)
        (tmp_path / "10" / "stat").write_text(f"10 (nsinit) S 9 10 10 {st.st_rdev} 10 0 0 0\n")
        (tmp_path / "11" / "stat").write_text(f"11 (job) S 10 11 10 {st.st_rdev} 11 0 0 0\n")
        ttys = TtySensor(tmp_path).external_ttys([10, 11, 12])
        assert ttys == [ExternalTty(st.st_rdev, st.st_dev, pts_index(slave_path) or 0,
                                    "/r/t.sock")]
        assert ttys[0].as_dict()["key"] == format_key(st.st_rdev, st.st_dev)
    finally:
        os.close(master)
        os.close(slave)


def test_criu_gets_the_extra_arguments_and_fds(tmp_path: Path) -> None:
    runner = FakeRunner()
    criu = Criu("criu", (4, 2), runner=runner)
    criu.dump(42, tmp_path, None, extra_args=["--external", "tty[8800:1a]"])
    assert runner.calls[-1][0][-2:] == ("--external", "tty[8800:1a]")
    (tmp_path / "restore.pid").write_text("77")

    seen: list[tuple[int, ...]] = []

    class Recording(FakeRunner):
        def run(self, argv, *, timeout=None, env=None, pass_fds=()):  # type: ignore[no-untyped-def]
            seen.append(tuple(pass_fds))
            (tmp_path / "restore.pid").write_text("77")
            return CommandResult(tuple(argv), 0, "", "")

    criu = Criu("criu", (4, 2), runner=Recording())
    assert criu.restore(tmp_path, tmp_path, None, None, ["--inherit-fd", "fd[9]:tty[1:2]"],
                        (9,)) == 77
    assert seen == [(9,)]


def test_nsinit_argv_and_exit_statuses() -> None:
    argv = nsinit_argv(["sleep", "1"], tty_fd=5, cgroup_procs=Path("/cg/cgroup.procs"),
                       python="/py")
    assert argv == ["/py", "-I", str(NSINIT), "--tty-fd", "5", "--cgroup-procs",
                    "/cg/cgroup.procs", "--", "sleep", "1"]
    assert nsinit.parse_args(argv[3:]) == (5, "/cg/cgroup.procs", ["sleep", "1"])
    assert nsinit.parse_args(["--", "a", "--", "b"]) == (None, None, ["a", "--", "b"])
    assert exit_status(0) == 0 and exit_status(3) == 3
    assert exit_status(-9) == 137 and exit_status(-15) == 143


def test_runtime_dir_prefers_the_users_own(tmp_path: Path) -> None:
    me = os.getuid()
    assert runtime_dir(me, {"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "oomguard"
    assert runtime_dir(me, {}) == SYSTEM_DIR / str(me)
    assert runtime_dir(me + 1, {"XDG_RUNTIME_DIR": str(tmp_path)}) == SYSTEM_DIR / str(me + 1)


def test_holder_of_checkpoint() -> None:
    assert holder_of_checkpoint({"extra": {"ttys": [{"key": "tty[1:2]", "socket": "/s"}]}}) \
        == "/s"
    assert holder_of_checkpoint({"extra": {}}) is None
    assert holder_of_checkpoint({}) is None


def test_only_a_holders_socket_of_the_user_is_trusted(tmp_path: Path) -> None:
    """A job's environment names its holder's socket: root talks to it, or replaces it, only
    when it is a socket with a holder's name, owned by the job's user."""
    import socket as socketlib

    from oomguard.terminal.client import HolderError, listen_at, trusted_socket

    good = tmp_path / "tty-0123abcd.sock"
    with listen_at(good, os.getuid(), os.getgid()):
        assert trusted_socket(good, os.getuid())
        with pytest.raises(HolderError, match="already listens"):
            listen_at(good, os.getuid(), os.getgid())
    plain = tmp_path / "tty-deadbeef.sock"
    plain.write_text("precious")
    assert not trusted_socket(plain, os.getuid())
    with pytest.raises(HolderError, match="not a socket"):
        listen_at(plain, os.getuid(), os.getgid())
    assert plain.read_text() == "precious"
    assert not trusted_socket(tmp_path / "control.sock", os.getuid())
    stale = tmp_path / "tty-00000000.sock"
    dead = socketlib.socket(socketlib.AF_UNIX)
    dead.bind(str(stale))
    dead.close()
    with listen_at(stale, os.getuid(), os.getgid()):  # a dead holder's socket is replaced
        assert trusted_socket(stale, os.getuid())


def test_a_new_holder_listens_where_the_old_one_did_only_in_safe_places(tmp_path: Path) -> None:
    from oomguard.terminal.leases import _replacement_path

    me = os.geteuid()
    old = tmp_path / "tty-0123abcd.sock"
    assert _replacement_path(str(old), me) == old  # the user's own directory, for themselves
    other = _replacement_path(str(old), me + 1000)  # root for another user: never their path
    assert other.parent == SYSTEM_DIR / str(me + 1000) and other != old
    assert _replacement_path("/etc/passwd", me).parent == SYSTEM_DIR / str(me)
    assert _replacement_path(None, me).parent == SYSTEM_DIR / str(me)
