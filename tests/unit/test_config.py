"""oomguard.config.loading: TOML -> validated dataclasses, every problem reported with file and key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.config.actions import Step
from oomguard.config.loading import (
    EMBEDDED_CONFIG,
    CriuConfig,
    DaemonConfig,
    GuardConfig,
    embedded_config_text,
    load_config,
    load_config_text,
    load_embedded_config,
)
from oomguard.model.errors import ConfigError, ConfigIssue

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "oomguard.toml"
MiB = 1 << 20

FULL = """\
[daemon]
store = "/srv/oomguard"
poll_interval = "250ms"
rescan_interval = "5s"
dry_run = true
nice = -5

[criu]
binary = "/opt/criu/sbin/criu"
ghost_limit = "128M"
timeout = "10m"
tcp_close = false
cgroup_limit = "1GiB"
checksum = "sha256"

[[guard]]
cgroup = "/jobs/a"
cgroups = ["/sys/fs/cgroup/memory/jobs/b", "/jobs/c"]
threshold = "90%"
headroom = "32M"
on_failure = "kill"
events = false

[[guard]]
cgroups = "/jobs/d"

[[guard]]
cgroup = "/jobs/e"
threshold = 0.5
headroom = 1048576
on_failure = "thaw"
events = true
"""


def test_full_config_exact_values() -> None:
    config = load_config_text(FULL, "full.toml")
    assert config == DaemonConfig(
        source="full.toml",
        store=Path("/srv/oomguard"),
        poll_interval=0.25,
        rescan_interval=5.0,
        dry_run=True,
        nice=-5,
        criu=CriuConfig(binary="/opt/criu/sbin/criu", ghost_limit=128 * MiB, timeout=600.0,
                        tcp_close=False, cgroup_limit=1024 * MiB, checksum="sha256"),
        guards=(
            GuardConfig(cgroups=("/jobs/a", "/sys/fs/cgroup/memory/jobs/b", "/jobs/c"),
                        threshold=0.9, headroom=32 * MiB, on_failure="kill", events=False),
            GuardConfig(cgroups=("/jobs/d",), threshold=0.85, headroom=64 * MiB, on_failure="thaw",
                        events=True),
            GuardConfig(cgroups=("/jobs/e",), threshold=0.5, headroom=MiB, on_failure="thaw",
                        events=True),
        ),
    )
    assert isinstance(config.poll_interval, float)
    assert isinstance(config.criu.ghost_limit, int)


def test_empty_config_is_all_defaults() -> None:
    config = load_config_text("", "empty.toml")
    assert config == DaemonConfig(source="empty.toml")
    assert config.store == Path("/var/lib/oomguard")
    assert (config.poll_interval, config.rescan_interval, config.dry_run) == (0.1, 60.0, False)
    assert config.nice == -10
    assert config.criu == CriuConfig(binary="auto", ghost_limit=64 * MiB, timeout=300.0,
                                     tcp_close=True, cgroup_limit=256 * MiB)
    assert config.guards == ()


def test_input_dict_not_mutated() -> None:
    from oomguard.config.loading import parse_config

    data = {"daemon": {"dry_run": True}, "guard": [{"cgroup": "/a"}]}
    parse_config(data, "x")
    assert data == {"daemon": {"dry_run": True}, "guard": [{"cgroup": "/a"}]}


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ('[[guard]]\ncgroup = "/a"\nthreshold = "150%"\n', "guard[0].threshold",
         "must be above 0% and at most 100%, got '150%'"),
        ('[[guard]]\ncgroup = "/a"\n[[guard]]\ncgroup = "/b"\nthreshold = "abc"\n',
         "guard[1].threshold", "expected a percentage such as '85%', got 'abc'"),
        ('[[guard]]\ncgroup = "/a"\nthreshold = 0\n', "guard[0].threshold",
         "must be above 0% and at most 100%"),
        ('[daemon]\npoll_interval = "fast"\n', "daemon.poll_interval",
         "expected a duration such as '150ms' or '2s', got 'fast'"),
        ('[daemon]\npoll_interval = "0ms"\n', "daemon.poll_interval", "must be above 0"),
        ('[daemon]\nrescan_interval = -1\n', "daemon.rescan_interval", "cannot be negative"),
        ('[daemon]\ndry_run = "yes"\n', "daemon.dry_run", "expected true or false, got 'yes'"),
        ('[daemon]\nnice = 5\n', "daemon.nice", "expected a niceness from -20 to 0"),
        ('[daemon]\nnice = -21\n', "daemon.nice", "expected a niceness from -20 to 0"),
        ('[daemon]\nnice = "high"\n', "daemon.nice", "got 'high'"),
        ('[daemon]\nnice = true\n', "daemon.nice", "got True"),
        ('[daemon]\nstore = ""\n', "daemon.store", "expected a non-empty string"),
        ('[daemon]\ncolour = "blue"\n', "daemon.colour", "unknown key"),
        ('deamon = 1\n', "deamon", "unknown key"),
        ('daemon = 1\n', "daemon", "expected a table ([daemon]), got int"),
        ('criu = "auto"\n', "criu", "expected a table ([criu]), got str"),
        ('[criu]\nghost_limit = "lots"\n', "criu.ghost_limit", "expected a size"),
        ('[criu]\ncgroup_limit = -1\n', "criu.cgroup_limit", "cannot be negative"),
        ('[criu]\nbinary = 3\n', "criu.binary", "expected a non-empty string, got 3"),
        ('[criu]\ntimeout = "forever"\n', "criu.timeout", "expected a duration"),
        ('[criu]\ntcp_close = 1\n', "criu.tcp_close", "expected true or false, got 1"),
        ('[criu]\nchecksum = "md5"\n', "criu.checksum", "expected one of 'xxh3', 'sha256'"),
        ('[criu]\nmount_namespace = "proc/1/ns/mnt"\n', "criu.mount_namespace",
         'expected "auto", "off" or an absolute path'),
        ('[criu]\nversion = "4.2"\n', "criu.version", "unknown key"),
        ("[[guard]]\nthreshold = \"85%\"\n", "guard[0].cgroups",
         "missing: which cgroups to guard (or system = true)"),
        ('[[guard]]\ncgroup = "jobs/a"\n', "guard[0].cgroup",
         "cgroup paths must be absolute, got 'jobs/a'"),
        ('[[guard]]\ncgroups = ["/a", "b"]\n', "guard[0].cgroups",
         "cgroup paths must be absolute, got 'b'"),
        ('[[guard]]\ncgroups = ["/a", ""]\n', "guard[0].cgroups",
         "expected a cgroup path or a list of them"),
        ('[[guard]]\ncgroups = 5\n', "guard[0].cgroups", "expected a cgroup path or a list of them"),
        ('[[guard]]\ncgroup = "/a"\non_failure = "restart"\n', "guard[0].on_failure",
         "expected 'thaw' or 'kill', got 'restart'"),
        ('[[guard]]\ncgroup = "/a"\nevents = "no"\n', "guard[0].events", "expected true or false"),
        ('[[guard]]\ncgroup = "/a"\nheadroom = "64Q"\n', "guard[0].headroom", "expected a size"),
        ('[[guard]]\ncgroup = "/a"\ntreshold = "85%"\n', "guard[0].treshold", "unknown key"),
        ('[guard]\ncgroup = "/a"\n', "guard", "expected [[guard]] tables"),
        ('guard = ["/a"]\n', "guard", "expected [[guard]] tables"),
    ],
    ids=lambda v: v if isinstance(v, str) and "\n" not in v and len(v) < 30 else None,
)
def test_single_error(text: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "/etc/oomguard/bad.toml")
    issues = info.value.issues
    assert [i.key for i in issues] == [key], issues
    [issue] = issues
    assert issue.source == "/etc/oomguard/bad.toml"
    assert reason in issue.reason
    assert str(issue) == f"/etc/oomguard/bad.toml: {key}: {issue.reason}"
    assert str(info.value) == str(issue)


@pytest.mark.parametrize(
    "text",
    ['[daemon\nstore = "/x"\n', "store = \n", '[[guard]]\ncgroup = "/a"\ncgroup = "/b"\n',
     "x = 'unterminated\n"],
    ids=["bracket", "no-value", "duplicate-key", "unterminated"],
)
def test_toml_syntax_error(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "syntax.toml")
    [issue] = info.value.issues
    assert (issue.source, issue.key) == ("syntax.toml", "(syntax)")
    assert "(at " in issue.reason  # tomllib says where: "(at line 1, column 8)"


def test_several_errors_reported_at_once() -> None:
    text = """\
colour = 1
[daemon]
poll_interval = "0s"
dry_run = "maybe"
[criu]
ghost_limit = "huge"
[[guard]]
cgroup = "/ok"
[[guard]]
threshold = "150%"
on_failure = "explode"
[[guard]]
cgroups = ["relative"]
headroom = "lots"
extra = 1
"""
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "many.toml")
    keys = [i.key for i in info.value.issues]
    assert sorted(keys) == sorted([
        "colour", "daemon.poll_interval", "daemon.dry_run", "criu.ghost_limit",
        "guard[1].cgroups", "guard[1].threshold", "guard[1].on_failure",
        "guard[2].cgroups", "guard[2].headroom", "guard[2].extra",
    ])
    assert all(i.source == "many.toml" for i in info.value.issues)
    assert len(str(info.value).splitlines()) == len(keys)
    reasons = {i.key: i.reason for i in info.value.issues}
    assert reasons["guard[1].cgroups"] == "missing: which cgroups to guard (or system = true)"
    assert reasons["guard[2].cgroups"] == "cgroup paths must be absolute, got 'relative'"


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.issues == [ConfigIssue(str(path), "(file)",
                                             "cannot read: No such file or directory")]


def test_load_config_reads_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text('[[guard]]\ncgroup = "/jobs"\n')
    config = load_config(path)
    assert config.source == str(path)
    assert config.guards == (GuardConfig(cgroups=("/jobs",)),)


def test_error_in_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[guard]]\ncgroup = "/jobs"\nthreshold = "0%"\n')
    with pytest.raises(ConfigError, match=rf"^{path}: guard\[0\]\.threshold: must be above 0%"):
        load_config(path)


# -- shipped and embedded config -----------------------------------------------------------------

def test_shipped_and_embedded_identical() -> None:
    assert embedded_config_text() == SHIPPED.read_text()


def test_shipped_config_loads() -> None:
    config = load_config(SHIPPED)
    assert config.guards == ()  # safe as shipped: guards nothing
    assert config == DaemonConfig(source=str(SHIPPED))  # and documents the defaults


def test_embedded_config_loads() -> None:
    config = load_embedded_config()
    assert config.source == EMBEDDED_CONFIG
    assert config == DaemonConfig(source=EMBEDDED_CONFIG)


def test_shipped_commented_guards_are_valid() -> None:
    """Uncommenting each documented [[guard]] example must give a valid config."""
    lines = SHIPPED.read_text().splitlines()
    blocks = []
    for start, line in enumerate(lines):
        if line.strip() != "# [[guard]]":
            continue
        end = start
        while end < len(lines) and lines[end].startswith("#"):
            end += 1
        # "# key = value" -> "key = value"; "# # comment" -> "# comment"
        blocks.append([ln[2:] if ln.startswith("# ") else ln for ln in lines[start:end]])
    head = lines[:next(i for i, line in enumerate(lines) if line.strip() == "# [[guard]]")]
    text = "\n".join(head + [ln for block in blocks for ln in block]) + "\n"
    config = load_config_text(text, "uncommented")
    assert config.guards == (
        GuardConfig(cgroups=("/sys/fs/cgroup/memory/jobs/build",), threshold=0.85,
                    headroom=64 * MiB, on_failure="thaw", events=True,
                    actions=(Step("checkpoint"), Step("pageout")),
                    protect=("^(sshd|systemd|Xorg|gnome-shell)$",), gpu="neutral",
                    signals=(("gpu_threshold", 0.95),)),
        GuardConfig(cgroups=(), system=True,
                    signals=(("min_available", 0.10), ("psi_full_avg10", 0.6)),
                    victim_cgroups=("/sys/fs/cgroup/user.slice",),
                    headroom=64 * MiB,
                    on_failure="thaw"),
    )


# -- the CLI -------------------------------------------------------------------------------------

def _oomguard(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "oomguard", "--log-format", "console", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_cli_check_config_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\npoll_interval = "soon"\n[[guard]]\ncgroup = "/a"\nthreshold = "2"\n')
    result = _oomguard("check-config", str(bad))
    assert result.returncode == 2, result
    assert f"oomguard: config error: {bad}: daemon.poll_interval: " in result.stderr
    assert f"oomguard: config error: {bad}: guard[0].threshold: " in result.stderr
    assert result.stdout == ""


def test_cli_check_config_missing_file(tmp_path: Path) -> None:
    result = _oomguard("check-config", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert f"{tmp_path / 'nope.toml'}: (file): cannot read" in result.stderr


def test_cli_check_config_ok(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(FULL)
    result = _oomguard("check-config", str(good))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{good}: OK (3 guard rule(s))"


def test_cli_check_config_shipped() -> None:
    result = _oomguard("check-config", str(SHIPPED))
    assert result.returncode == 0, result.stderr
    assert "OK (0 guard rule(s))" in result.stdout


@pytest.mark.parametrize("bad_id", ["../etc", "a/b", ".partial-x"])
def test_cli_restore_invalid_id(tmp_path: Path, bad_id: str) -> None:
    store = tmp_path / "store"
    store.mkdir()  # (a store that is not there is refused before the id is read)
    result = _oomguard("--store", str(store), "restore", bad_id)
    assert result.returncode != 0
    if os.geteuid() == 0:
        assert result.returncode == 1
        assert result.stderr.strip().endswith(f"oomguard: invalid checkpoint id {bad_id!r}")
    else:
        assert "needs root" in result.stderr
    assert not list(store.iterdir())  # nothing created on the way


# -- values that parse but would break the daemon at run time -------------------------------------

@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[daemon]\npoll_interval = nan\n', "daemon.poll_interval"),
        ('[daemon]\nrescan_interval = "0s"\n', "daemon.rescan_interval"),
        ('[daemon]\nrescan_interval = nan\n', "daemon.rescan_interval"),
        ('[[guard]]\ncgroups = []\n', "guard[0].cgroups"),
    ],
    ids=["poll-nan", "rescan-zero", "rescan-nan", "empty-cgroups"],
)
def test_values_that_would_break_the_daemon_are_rejected(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "gap.toml")
    assert [i.key for i in caught.value.issues] == [key]
