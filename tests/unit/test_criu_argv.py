"""oomguard.act.criu: version parsing, argv building, binary discovery with a fake runner, log tails."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from oomguard.act import criu as criu_mod
from oomguard.act.criu import (
    DUMP_LOG,
    RESTORE_LOG,
    Criu,
    CriuOptions,
    dump_argv,
    find_criu,
    format_version,
    log_tail,
    parse_version,
    probe_version,
    restore_argv,
)
from oomguard.cgroup.v1 import V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup
from oomguard.lifecycle.restore import cgroup_root_arg
from oomguard.model.errors import CriuError
from oomguard.model.runner import CommandResult
from tests.unit._support import FIXTURES, make_executable

# -- parse_version -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Version: 4.2.1\n", (4, 2, 1)),
        ("Version: 4.2\nGitID: v4.2-31-g0a1b2c3d4\n", (4, 2)),
        ("Version: 3.17.1\n", (3, 17, 1)),
        ("Version: 4.1.1\nGitID: v4.1.1\n", (4, 1, 1)),
        ("Version:4.2\n", (4, 2)),
        ("Warn: something\nVersion: 4.2.1\n", (4, 2, 1)),  # not on the first line
        ("", None),
        ("criu: command not found\n", None),
        ("GitID: v4.2\n", None),
        ("Version: \n", None),
        ("Version: dev\n", None),
        ("  Version: 4.2\n", None),  # must start a line
    ],
    ids=["4.2.1", "gitid", "3.17.1", "4.1.1", "no-space", "second-line", "empty", "garbage",
         "gitid-only", "empty-version", "non-numeric", "indented"],
)
def test_parse_version(text: str, expected: tuple[int, ...] | None) -> None:
    assert parse_version(text) == expected


@pytest.mark.parametrize(("version", "text"), [((4, 2, 1), "4.2.1"), ((3, 17), "3.17"), ((4,), "4")])
def test_format_version(version: tuple[int, ...], text: str) -> None:
    assert format_version(version) == text


# -- argv ----------------------------------------------------------------------------------------

IMAGES = Path("/var/lib/oomguard/.partial-x/images")
HOOK = Path("/run/oomguard/criu-post-dump")
ALL_OFF = CriuOptions(ghost_limit=1 << 30, seize_timeout=3, shell_job=False, tcp_close=False,
                      ext_unix_sk=False, file_locks=False, log_level=2, skip_in_flight=False,
                      extra_dump_args=("--skip-in-flight",), extra_restore_args=("--lazy-pages",))
TOGGLES = ("--shell-job", "--tcp-close", "--ext-unix-sk", "--file-locks")


def _value_after(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_dump_argv_defaults() -> None:
    argv = dump_argv("/usr/local/sbin/criu", 4242, IMAGES, CriuOptions(), HOOK)
    assert argv[:2] == ["/usr/local/sbin/criu", "dump"]
    assert _value_after(argv, "--tree") == "4242"
    assert _value_after(argv, "--images-dir") == str(IMAGES)
    assert _value_after(argv, "--log-file") == DUMP_LOG
    assert _value_after(argv, "--ghost-limit") == str(64 * 1024 * 1024)
    assert _value_after(argv, "--timeout") == "10"
    assert _value_after(argv, "--action-script") == str(HOOK)
    assert "-v4" in argv
    for flag in TOGGLES:
        assert argv.count(flag) == 1, flag
    assert argv == [
        "/usr/local/sbin/criu", "dump", "--tree", "4242", "--images-dir", str(IMAGES),
        "--log-file", "dump.log", "--ghost-limit", "67108864", "--timeout", "10", "-v4",
        "--shell-job", "--tcp-close", "--ext-unix-sk", "--file-locks", "--skip-in-flight",
        "--action-script", str(HOOK),
    ]


def test_dump_argv_non_default() -> None:
    argv = dump_argv("criu", 7, IMAGES, ALL_OFF, None)
    assert _value_after(argv, "--ghost-limit") == "1073741824"
    assert _value_after(argv, "--timeout") == "3"
    assert "-v2" in argv and "-v4" not in argv
    for flag in (*TOGGLES, "--action-script"):
        assert flag not in argv
    assert argv[-1] == "--skip-in-flight"  # extra arguments come last
    assert "--lazy-pages" not in argv


def test_restore_argv_defaults(tmp_path: Path) -> None:
    pidfile = tmp_path / "restore.pid"
    argv = restore_argv("/usr/sbin/criu", IMAGES, CriuOptions(), pidfile, None, tmp_path)
    assert argv[:2] == ["/usr/sbin/criu", "restore"]
    assert _value_after(argv, "--images-dir") == str(IMAGES)
    assert _value_after(argv, "--work-dir") == str(tmp_path)
    assert _value_after(argv, "--log-file") == RESTORE_LOG
    assert _value_after(argv, "--pidfile") == str(pidfile)
    assert "--restore-detached" in argv
    for flag in TOGGLES:
        assert argv.count(flag) == 1, flag
    for flag in ("--cgroup-root", "--tree", "--ghost-limit", "--action-script",
                 "--skip-in-flight"):  # a dump option only
        assert flag not in argv


@pytest.mark.parametrize("root", ["memory:/x", "memory:/jobs/restored", "/user.slice/job"])
def test_restore_argv_cgroup_root(tmp_path: Path, root: str) -> None:
    argv = restore_argv("criu", IMAGES, ALL_OFF, tmp_path / "p", root, tmp_path)
    assert _value_after(argv, "--cgroup-root") == root
    assert argv[-1] == "--lazy-pages"
    assert "--skip-in-flight" not in argv
    for flag in TOGGLES:
        assert flag not in argv
    assert "--restore-detached" in argv  # not optional


# -- Criu.confined ----------------------------------------------------------------------------------

@dataclass
class FakeRunner:
    """Stands in for SubprocessRunner: answers from a table, records what it was asked."""

    answers: dict[str, CommandResult | Exception] = field(default_factory=dict)
    calls: list[tuple[tuple[str, ...], float | None]] = field(default_factory=list)
    side_effect: Callable[[Sequence[str]], None] | None = None

    def run(self, argv: Sequence[str], *, timeout: float | None = None,
            env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = ()) -> CommandResult:
        self.calls.append((tuple(argv), timeout))
        if self.side_effect is not None:
            self.side_effect(argv)
        answer = self.answers.get(argv[0], CommandResult(tuple(argv), 0, "", ""))
        if isinstance(answer, Exception):
            raise answer
        return answer


def _version_result(binary: str, stdout: str, rc: int = 0) -> CommandResult:
    return CommandResult((binary, "--version"), rc, stdout, "")


def test_wrap_without_cgroup_is_identity() -> None:
    c = Criu("/usr/sbin/criu", (4, 2), runner=FakeRunner())
    assert c.confined(["criu", "dump"]) == ["criu", "dump"]


def test_wrap_with_cgroup_procs() -> None:
    procs = Path("/sys/fs/cgroup/memory/oomguard-criu/cgroup.procs")
    c = Criu("/usr/sbin/criu", (4, 2), runner=FakeRunner(), cgroup_procs=procs)
    assert c.confined(["criu", "dump", "--tree", "1 2"]) == [
        "/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), "criu", "dump", "--tree", "1 2"]


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="no /bin/sh")
def test_wrap_really_moves_the_exec_d_process(tmp_path: Path) -> None:
    """The wrapper writes its own pid, then execs: the pid written is the command's pid."""
    procs = tmp_path / "cgroup procs"  # a space in the path must survive
    procs.write_text("")
    c = Criu("criu", (4, 2), cgroup_procs=procs)
    out = subprocess.run(c.confined(["/bin/sh", "-c", 'echo "$$" "$1"', "sh", "arg with space"]),
                         capture_output=True, text=True, timeout=10, check=True).stdout.split(" ", 1)
    assert out[1] == "arg with space\n"
    assert procs.read_text().strip() == out[0]


# -- Criu.dump / restore with a fake runner -------------------------------------------------------

def test_dump_runs_wrapped_argv_with_timeout(tmp_path: Path) -> None:
    runner = FakeRunner()
    procs = tmp_path / "cgroup.procs"
    c = Criu("/usr/sbin/criu", (4, 2), runner=runner, options=CriuOptions(timeout=42.0),
             cgroup_procs=procs)
    c.dump(4242, tmp_path, HOOK)
    [(argv, timeout)] = runner.calls
    assert timeout == 42.0
    assert argv[:4] == ("/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs))
    assert list(argv[4:]) == dump_argv("/usr/sbin/criu", 4242, tmp_path, CriuOptions(timeout=42.0),
                                       HOOK)


def test_dump_failure_carries_log_errors(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "criu" / "dump.log", tmp_path / DUMP_LOG)
    runner = FakeRunner({"criu": CommandResult(("criu",), 1, "", "stderr noise")})
    with pytest.raises(CriuError, match="criu dump exited with status 1") as info:
        Criu("criu", (4, 2), runner=runner).dump(1, tmp_path, None)
    assert "Connected TCP socket" in info.value.log_tail
    assert "RLIMIT_NOFILE" not in info.value.log_tail
    assert "stderr noise" not in str(info.value)


def test_dump_failure_without_log_uses_stderr(tmp_path: Path) -> None:
    runner = FakeRunner({"criu": CommandResult(("criu",), 1, "", "Error: cannot open images\n")})
    with pytest.raises(CriuError) as info:
        Criu("criu", (4, 2), runner=runner).dump(1, tmp_path, None)
    assert info.value.log_tail == "Error: cannot open images"


def test_dump_timeout(tmp_path: Path) -> None:
    runner = FakeRunner({"criu": CommandResult(("criu",), -9, "", "", timed_out=True)})
    with pytest.raises(CriuError, match="criu dump timed out after 300s"):
        Criu("criu", (4, 2), runner=runner).dump(1, tmp_path, None)


def test_restore_returns_pidfile_pid(tmp_path: Path) -> None:
    def write_pid(argv: Sequence[str]) -> None:
        Path(argv[argv.index("--pidfile") + 1]).write_text("31337\n")

    (tmp_path / "restore.pid").write_text("1\n")  # stale: removed before CRIU runs
    runner = FakeRunner(side_effect=write_pid)
    pid = Criu("criu", (4, 2), runner=runner).restore(tmp_path / "images", tmp_path, "memory:/x")
    assert pid == 31337
    [(argv, _)] = runner.calls
    assert argv[argv.index("--cgroup-root") + 1] == "memory:/x"


def test_restore_without_pidfile(tmp_path: Path) -> None:
    (tmp_path / "restore.pid").write_text("1\n")  # stale: must not be believed
    with pytest.raises(CriuError, match="wrote no pidfile"):
        Criu("criu", (4, 2), runner=FakeRunner()).restore(tmp_path / "images", tmp_path, None)


def test_restore_failure(tmp_path: Path) -> None:
    (tmp_path / RESTORE_LOG).symlink_to(tmp_path / "elsewhere")  # removed, never followed

    def criu_writes_its_log(argv: Sequence[str]) -> None:
        (tmp_path / RESTORE_LOG).write_text("(00.1) Error (criu/cr-restore.c:1): Can't fork "
                                            "for 4242: File exists\n(00.2) Restoring FAILED.\n")

    runner = FakeRunner({"criu": CommandResult(("criu",), 1, "", "")},
                        side_effect=criu_writes_its_log)
    with pytest.raises(CriuError, match="criu restore exited with status 1") as info:
        Criu("criu", (4, 2), runner=runner).restore(tmp_path / "images", tmp_path, None)
    assert "Can't fork for 4242" in info.value.log_tail
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize(
    ("rc", "out", "ok", "line"),
    [
        (0, "Warn: ...\nLooks good.\n", True, "Looks good."),
        (1, "Error: no kcmp\n", False, "Error: no kcmp"),
        (0, "", False, "exit status 0"),
    ],
)
def test_check(rc: int, out: str, ok: bool, line: str) -> None:
    runner = FakeRunner({"criu": CommandResult(("criu", "check"), rc, out, "")})
    assert Criu("criu", (4, 2), runner=runner).check() == (ok, line)


# -- probe_version / find_criu -------------------------------------------------------------------

@pytest.fixture
def no_system_criu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No criu anywhere but where the test puts one: candidates, $PATH and $OOMGUARD_CRIU."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("OOMGUARD_CRIU", raising=False)
    monkeypatch.setattr(criu_mod, "CRIU_CANDIDATES", ())
    return tmp_path


def test_probe_version(tmp_path: Path) -> None:
    runner = FakeRunner({
        "/a": _version_result("/a", "Version: 4.2.1\n"),
        "/b": _version_result("/b", "Version: 4.2.1\n", rc=1),
        "/c": OSError(8, "Exec format error"),
    })
    assert probe_version("/a", runner) == (4, 2, 1)
    assert probe_version("/b", runner) is None
    assert probe_version("/c", runner) is None
    assert runner.calls[0] == (("/a", "--version"), 10)


def test_find_criu_picks_first_new_enough(no_system_criu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = no_system_criu
    old = make_executable(d / "usr/local/sbin/criu")
    older = make_executable(d / "usr/sbin/criu")
    good = make_executable(d / "usr/bin/criu")
    newer = make_executable(d / "opt/criu")
    monkeypatch.setattr(criu_mod, "CRIU_CANDIDATES", (str(old), str(older), str(good), str(newer)))
    runner = FakeRunner({
        str(old): _version_result(str(old), "Version: 3.17\n"),
        str(older): _version_result(str(older), "Version: 4.1.1\nGitID: v4.1.1\n"),
        str(good): _version_result(str(good), "Version: 4.2\n"),
        str(newer): _version_result(str(newer), "Version: 4.3\n"),
    })
    assert find_criu(runner=runner) == (str(good), (4, 2))
    assert [c[0][0] for c in runner.calls] == [str(old), str(older), str(good)]  # stops at the first


def test_find_criu_error_lists_what_was_found(no_system_criu: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    d = no_system_criu
    old = make_executable(d / "a/criu")
    older = make_executable(d / "b/criu")
    broken = make_executable(d / "c/criu")
    not_exec = make_executable(d / "d/criu", mode=0o644)
    missing = d / "e/criu"
    monkeypatch.setattr(criu_mod, "CRIU_CANDIDATES",
                        (str(old), str(missing), str(not_exec), str(older), str(broken)))
    runner = FakeRunner({
        str(old): _version_result(str(old), "Version: 3.17\n"),
        str(older): _version_result(str(older), "Version: 4.1.1\n"),
        str(broken): _version_result(str(broken), "", rc=127),
    })
    with pytest.raises(CriuError) as info:
        find_criu(runner=runner)
    message = str(info.value)
    assert message == (f"no CRIU >= 4.2 found (found: {old} (3.17), {older} (4.1.1), "
                       f"{broken} (no version)); run scripts/setup to build one")
    # neither the missing nor the non-executable candidate was run
    assert {c[0][0] for c in runner.calls} == {str(old), str(older), str(broken)}


def test_find_criu_nothing_found(no_system_criu: Path) -> None:
    runner = FakeRunner()
    with pytest.raises(CriuError, match=r"found: none"):
        find_criu(runner=runner)
    assert runner.calls == []


def test_find_criu_configured_path_only(no_system_criu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = no_system_criu
    configured = make_executable(d / "configured/criu")
    candidate = make_executable(d / "usr/sbin/criu")
    monkeypatch.setattr(criu_mod, "CRIU_CANDIDATES", (str(candidate),))
    runner = FakeRunner({
        str(configured): _version_result(str(configured), "Version: 3.19\n"),
        str(candidate): _version_result(str(candidate), "Version: 4.2\n"),
    })
    with pytest.raises(CriuError, match=r"found: .*configured/criu \(3\.19\)"):
        find_criu(str(configured), runner=runner)
    assert {c[0][0] for c in runner.calls} == {str(configured)}  # the candidates are not tried
    assert find_criu("auto", runner=runner) == (str(candidate), (4, 2))


def test_find_criu_env_then_candidates_then_path(no_system_criu: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    d = no_system_criu
    env = make_executable(d / "env/criu")
    cand = make_executable(d / "cand/criu")
    on_path = make_executable(d / "bin/criu")
    monkeypatch.setenv("PATH", str(d / "bin"))
    monkeypatch.setattr(criu_mod, "CRIU_CANDIDATES", (str(cand), str(env)))  # env listed twice
    runner = FakeRunner({
        str(env): _version_result(str(env), "Version: 4.0\n"),
        str(cand): _version_result(str(cand), "Version: 4.1\n"),
        str(on_path): _version_result(str(on_path), "Version: 4.2.1\n"),
    })
    monkeypatch.setenv("OOMGUARD_CRIU", str(env))
    assert find_criu(runner=runner) == (str(on_path), (4, 2, 1))
    assert [c[0][0] for c in runner.calls] == [str(env), str(cand), str(on_path)]  # deduplicated


def test_find_criu_custom_minimum(no_system_criu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = make_executable(no_system_criu / "criu")
    monkeypatch.setattr(criu_mod, "CRIU_CANDIDATES", (str(old),))
    runner = FakeRunner({str(old): _version_result(str(old), "Version: 3.17\n")})
    assert find_criu(runner=runner, minimum=(3, 17)) == (str(old), (3, 17))


# -- log_tail ------------------------------------------------------------------------------------

def test_log_tail_picks_errors_ignores_rlimit() -> None:
    tail = log_tail(FIXTURES / "criu" / "dump.log")
    assert tail.splitlines() == [
        "(00.010221) Error (criu/sk-inet.c:188): inet: Connected TCP socket, consider using "
        "--tcp-established option.",
        "(00.010390) Error (criu/cr-dump.c:1681): Dump files (pid: 4242) failed with -1",
        "(00.011930) Error (criu/cr-dump.c:2111): Dumping FAILED.",
    ]


def test_log_tail_without_errors_is_the_last_lines() -> None:
    path = FIXTURES / "criu" / "dump-ok.log"
    lines = path.read_text().splitlines()
    assert log_tail(path) == "\n".join(lines[-12:])
    assert log_tail(path, lines=2).splitlines() == lines[-2:]


def test_log_tail_limits_error_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"(0.{i}) Error (x.c:{i}): e{i}\n" for i in range(30)))
    tail = log_tail(log, lines=5).splitlines()
    assert [line.rsplit(" ", 1)[1] for line in tail] == ["e25", "e26", "e27", "e28", "e29"]


def test_log_tail_missing_or_binary(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "absent.log") == ""
    (tmp_path / "bin.log").write_bytes(b"\xff\xfe Error \x00 bad\n")
    assert "Error" in log_tail(tmp_path / "bin.log")


# -- cgroup_root_arg -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        (V1MemoryCgroup("/sys/fs/cgroup/memory/jobs/x", "/sys/fs/cgroup/memory"), "memory:/jobs/x"),
        (V1MemoryCgroup("/sys/fs/cgroup/memory", "/sys/fs/cgroup/memory"), "memory:/"),
        (V2MemoryCgroup("/sys/fs/cgroup/user.slice/x", "/sys/fs/cgroup"), "/user.slice/x"),
        (V2MemoryCgroup("/sys/fs/cgroup", "/sys/fs/cgroup"), "/"),
    ],
    ids=["v1", "v1-root", "v2", "v2-root"],
)
def test_cgroup_root_arg(cgroup: V1MemoryCgroup | V2MemoryCgroup, expected: str) -> None:
    assert cgroup_root_arg(cgroup) == expected


# -- SubprocessRunner: a blocking wait, a timer for the timeout ---------------------------------

def test_runner_returns_as_soon_as_the_command_ends() -> None:
    """Popen.wait(timeout) polls with sleeps of up to 50 ms; the runner does not."""
    from oomguard.model.runner import SubprocessRunner

    start = time.monotonic()
    result = SubprocessRunner().run(["sh", "-c", "sleep 0.12; echo hi"], timeout=30)
    assert (result.returncode, result.stdout, result.timed_out) == (0, "hi\n", False)
    assert time.monotonic() - start < 0.16


def test_runner_kills_the_whole_group_at_the_timeout() -> None:
    from oomguard.model.runner import SubprocessRunner

    start = time.monotonic()
    result = SubprocessRunner().run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.3)
    assert result.timed_out and result.returncode == -9
    assert time.monotonic() - start < 5
