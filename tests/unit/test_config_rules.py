"""oomguard.config.loading, the rule keys (actions, preferences, timing, store, system rules, daemon
socket and store keeping): each parses to its internal unit, each bad value is reported with the
file and the dotted key. And oomguard.respond.actor.rule_parts: a rule's compiled pieces."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest

from oomguard.config.actions import (
    CHECKPOINT,
    DEFAULT_CHAIN,
    FREEZE,
    KILL,
    PAGEOUT,
    SIGNAL,
    Step,
)
from oomguard.config.loading import DaemonConfig, GuardConfig, load_config, load_config_text
from oomguard.model.errors import ConfigError
from oomguard.policy.preferences import Preferences
from oomguard.respond.actor import RuleParts, rule_parts
from oomguard.respond.chain import ChainSettings

MiB = 1 << 20
GiB = 1 << 30
SOURCE = "/etc/oomguard/rules.toml"
GUARD = '[[guard]]\ncgroup = "/jobs/a"\n'
SYSTEM = "[[guard]]\nsystem = true\n"


def guard(lines: str, head: str = GUARD) -> GuardConfig:
    [spec] = load_config_text(head + lines + "\n", SOURCE).guards
    return spec


def daemon(lines: str) -> DaemonConfig:
    return load_config_text("[daemon]\n" + lines + "\n", SOURCE)


def only_issue(text: str) -> tuple[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, SOURCE)
    [issue] = info.value.issues
    assert issue.source == SOURCE
    assert str(info.value) == f"{SOURCE}: {issue.key}: {issue.reason}"
    return issue.key, issue.reason


def regex_error(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"bad regular expression {pattern!r}: {exc}"
    raise AssertionError(f"{pattern!r} compiles")


# -- values parse to internal units ---------------------------------------------------------------

@pytest.mark.parametrize(
    ("line", "attr", "expected"),
    [
        ('actions = ["checkpoint"]', "actions", (Step(CHECKPOINT),)),
        ('actions = ["checkpoint", "kill"]', "actions", (Step(CHECKPOINT), Step(KILL))),
        ('actions = ["freeze", "signal:SIGUSR1:30s", "checkpoint", "kill"]', "actions",
         (Step(FREEZE), Step(SIGNAL, signal.SIGUSR1, 30.0), Step(CHECKPOINT), Step(KILL))),
        ('actions = ["signal:term:500ms", "signal:INT:2", "kill"]', "actions",
         (Step(SIGNAL, signal.SIGTERM, 0.5), Step(SIGNAL, signal.SIGINT, 2.0), Step(KILL))),
        ('actions = ["KILL"]', "actions", (Step(KILL),)),
        ('prefer = "^python"', "prefer", ("^python",)),
        ('prefer = ["^python", "train\\\\.py"]', "prefer", ("^python", "train\\.py")),
        ('prefer = []', "prefer", ()),
        ('avoid = "firefox|chrome"', "avoid", ("firefox|chrome",)),
        ('avoid = ["a", "b", "c"]', "avoid", ("a", "b", "c")),
        ('protect = "^sshd$"', "protect", ("^sshd$",)),
        ('protect = ["^postgres", "^Xorg$"]', "protect", ("^postgres", "^Xorg$")),
        ("protect_session_leaders = true", "protect_session_leaders", True),
        ("protect_session_leaders = false", "protect_session_leaders", False),
        ("take_sessions = true", "take_sessions", True),
        ("take_sessions = false", "take_sessions", False),
        ('post_action_delay = "15s"', "post_action_delay", 15.0),
        ('post_action_delay = "1m"', "post_action_delay", 60.0),
        ('post_action_delay = "250ms"', "post_action_delay", 0.25),
        ("post_action_delay = 3", "post_action_delay", 3.0),
        ("time_to_limit = true", "time_to_limit", True),
        ('predict_from = "50%"', "predict_from", 0.5),
        ('predict_from = "100%"', "predict_from", 1.0),
        ("predict_from = 0.75", "predict_from", 0.75),
        ('freeze_deadline = "90s"', "freeze_deadline", 90.0),
        ('freeze_deadline = "2m"', "freeze_deadline", 120.0),
        ("oom_kill_disable = false", "oom_kill_disable", False),
        ('park_deadline = "1s"', "park_deadline", 1.0),
        ('park_deadline = "2m"', "park_deadline", 120.0),
        ('park_deadline = "1h"', "park_deadline", 3600.0),
        ('kill_grace = "500ms"', "kill_grace", 0.5),
        ("kill_grace = 10", "kill_grace", 10.0),
        ('store_margin = "256M"', "store_margin", 256 * MiB),
        ('store_margin = "1GiB"', "store_margin", GiB),
        ("store_margin = 4096", "store_margin", 4096),
        ("store_margin = 0", "store_margin", 0),
        ("auto_restore = true", "auto_restore", True),
        ('restore_quiet = "30s"', "restore_quiet", 30.0),
        ('restore_quiet = "1h"', "restore_quiet", 3600.0),
        ('restore_margin = "128M"', "restore_margin", 128 * MiB),
        ('restore_margin = "1.5G"', "restore_margin", 3 * GiB // 2),
        ("restore_attempts = 5", "restore_attempts", 5),
        ('restore_retry = "5s"', "restore_retry", 5.0),
    ],
)
def test_guard_key_parses(line: str, attr: str, expected: Any) -> None:
    spec = guard(line)
    plugin = attr in spec.signal_settings()  # a detection plug-in's key (oomguard.detect)
    got = spec.signal_settings()[attr] if plugin else getattr(spec, attr)
    assert got == expected
    assert type(got) is type(expected)
    # nothing else moved
    given = {"signals": ((attr, expected),)} if plugin else {attr: expected}
    assert GuardConfig(cgroups=("/jobs/a",), **given) == spec


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('min_available = "10%"', 0.1),
        ('min_available = "2.5%"', 0.025),
        ("min_available = 0.05", 0.05),
        ('min_available = "2G"', 2 * GiB),
        ('min_available = "512M"', 512 * MiB),
        ("min_available = 1073741824", GiB),
    ],
)
def test_min_available_fraction_or_bytes(line: str, expected: float | int) -> None:
    spec = guard(line, head=SYSTEM)
    assert spec.system is True
    assert spec.cgroups == ()
    assert spec.min_available == pytest.approx(expected)
    # a float is a share of MemTotal, an int a size in bytes
    assert type(spec.min_available) is type(expected)


def test_system_rule_defaults() -> None:
    spec = guard("", head=SYSTEM)
    assert spec == GuardConfig(cgroups=(), system=True)
    assert spec.min_available == 0.10 and isinstance(spec.min_available, float)
    assert spec.victim_cgroups == ()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('victim_cgroups = "/sys/fs/cgroup/user.slice"', ("/sys/fs/cgroup/user.slice",)),
        ('victim_cgroups = ["/user.slice", "/system.slice/app.service"]',
         ("/user.slice", "/system.slice/app.service")),
        ("victim_cgroups = []", ()),
    ],
)
def test_victim_cgroups(line: str, expected: tuple[str, ...]) -> None:
    assert guard(line, head=SYSTEM).victim_cgroups == expected


def test_all_rule_keys_together() -> None:
    spec = guard("""\
actions = ["freeze", "checkpoint", "kill"]
prefer = "^python"
avoid = ["^firefox"]
protect = ["^sshd$"]
protect_session_leaders = true
post_action_delay = "15s"
time_to_limit = true
predict_from = "50%"
freeze_deadline = "30s"
kill_grace = "2s"
store_margin = "512M"
auto_restore = true
restore_quiet = "20s"
restore_margin = "32M"
""")
    assert spec == GuardConfig(
        cgroups=("/jobs/a",), actions=(Step(FREEZE), Step(CHECKPOINT), Step(KILL)),
        prefer=("^python",), avoid=("^firefox",), protect=("^sshd$",),
        protect_session_leaders=True, post_action_delay=15.0,
        signals=(("time_to_limit", True), ("predict_from", 0.5)), freeze_deadline=30.0,
        kill_grace=2.0, store_margin=512 * MiB, auto_restore=True, restore_quiet=20.0,
        restore_margin=32 * MiB)


def test_guard_defaults_for_new_keys() -> None:
    spec = guard("")
    assert spec.actions == ()
    assert (spec.prefer, spec.avoid, spec.protect) == ((), (), ())
    assert spec.protect_session_leaders is False
    assert spec.post_action_delay == 0.0
    assert spec.signal_settings()["time_to_limit"] is False
    assert spec.signal_settings()["predict_from"] == 0.5
    assert (spec.freeze_deadline, spec.kill_grace, spec.store_margin) == (60.0, 5.0, 256 * MiB)
    assert (spec.auto_restore, spec.restore_quiet, spec.restore_margin) == (False, 10.0, 64 * MiB)
    assert (spec.restore_attempts, spec.restore_retry) == (3, 60.0)
    assert (spec.oom_kill_disable, spec.park_deadline) == (True, 30.0)  # v1: parked, not killed


@pytest.mark.parametrize(
    ("line", "attr", "expected"),
    [
        ('socket = "/tmp/oomguard/control.sock"', "socket", Path("/tmp/oomguard/control.sock")),
        ('store_max_size = "0"', "store_max_size", None),
        ('store_max_size = "none"', "store_max_size", None),
        ('store_max_size = "None"', "store_max_size", None),
        ('store_max_size = " 0 "', "store_max_size", None),
        ('store_max_size = "0G"', "store_max_size", None),
        ("store_max_size = 0", "store_max_size", None),
        ('store_max_size = "20G"', "store_max_size", 20 * GiB),
        ('store_max_size = "512MiB"', "store_max_size", 512 * MiB),
        ("store_max_size = 1048576", "store_max_size", MiB),
        ('store_max_size = "10%"', "store_max_size", 0.10),
        ("store_max_size = 0.25", "store_max_size", 0.25),
        ('store_max_size = "0%"', "store_max_size", None),
        ('store_keep_free = "15%"', "store_keep_free", 0.15),
        ('store_keep_free = "2G"', "store_keep_free", 2 * GiB),
        ('store_keep_free = "none"', "store_keep_free", None),
        ('store_max_age = "30d"', "store_max_age", 30 * 86400.0),
        ('store_max_age = "12h"', "store_max_age", 43200.0),
        ("store_max_age = 3600", "store_max_age", 3600.0),
        ('store_max_age = "0"', "store_max_age", None),
        ('store_max_age = "none"', "store_max_age", None),
        ('store_max_age = "0s"', "store_max_age", None),
        ("store_max_age = 0", "store_max_age", None),
    ],
)
def test_daemon_key_parses(line: str, attr: str, expected: Any) -> None:
    config = daemon(line)
    assert getattr(config, attr) == expected
    assert type(getattr(config, attr)) is type(expected)
    assert config == DaemonConfig(source=SOURCE, **{attr: expected})


def test_daemon_defaults_for_new_keys() -> None:
    config = load_config_text("", SOURCE)
    assert config.socket == Path("/run/oomguard/control.sock")
    # The store's budget by default, as systemd-coredump's and journald's: 10% of its file
    # system at most, and 15% of it kept free.
    assert config.store_max_size == 0.10 and config.store_keep_free == 0.15
    assert config.store_max_age == 30 * 86400.0


# -- bad values: the exact reason under the exact key ------------------------------------------

BAD_GUARD = [
    ('actions = ["kill", "checkpoint"]', "actions",
     "'kill' can only be the last action: nothing runs after it"),
    ('actions = ["checkpoint", "kill", "kill"]', "actions",
     "'kill' can only be the last action: nothing runs after it"),
    ('actions = ["checkpoint", "freeze"]', "actions", "'freeze' can only be the first action"),
    ('actions = ["reboot"]', "actions",
     "unknown action 'reboot': expected freeze, checkpoint, signal:SIG:GRACE, vram, pageout or kill"),
    ('actions = ["checkpoint", "oom-kill"]', "actions",
     "unknown action 'oom-kill': expected freeze, checkpoint, signal:SIG:GRACE, vram, pageout or kill"),
    ('actions = ["signal:SIGNOPE:5s"]', "actions",
     "unknown signal 'SIGNOPE' in 'signal:SIGNOPE:5s'"),
    ('actions = ["signal:SIGKILL:5s"]', "actions",
     "SIGKILL cannot be a cooperative signal: use 'kill' or 'freeze'"),
    ('actions = ["signal:STOP:5s"]', "actions",
     "SIGSTOP cannot be a cooperative signal: use 'kill' or 'freeze'"),
    ('actions = ["signal:USR1"]', "actions",
     "expected 'signal:SIGNAME:GRACE' such as 'signal:SIGUSR1:30s', got 'signal:USR1'"),
    ('actions = ["signal:USR1:0s"]', "actions", "the grace period must be above 0, got '0s'"),
    ('actions = ["signal:USR1:later"]', "actions",
     "expected a duration such as '150ms' or '2s', got 'later'"),
    ('actions = ["kill:now"]', "actions", "'kill' takes no arguments, got 'kill:now'"),
    ('actions = "checkpoint"', "actions",
     "expected a non-empty list of actions, got 'checkpoint'"),
    ("actions = []", "actions", "expected a non-empty list of actions, got []"),
    ('actions = ["checkpoint", "checkpoint"]', "actions",
     "an action other than 'signal' appears twice"),
    ("actions = [1]", "actions", "expected an action such as 'checkpoint', got 1"),
    ('prefer = "("', "prefer", regex_error("(")),
    ('avoid = ["ok", "[z-a]"]', "avoid", regex_error("[z-a]")),
    ('protect = "*x"', "protect", regex_error("*x")),
    ("protect = 5", "protect", "expected a regular expression or a list of them, got 5"),
    ("prefer = [5]", "prefer", "expected a regular expression string, got 5"),
    ("avoid = { a = 1 }", "avoid",
     "expected a regular expression or a list of them, got {'a': 1}"),
    ('protect_session_leaders = "yes"', "protect_session_leaders",
     "expected true or false, got 'yes'"),
    ("take_sessions = 1", "take_sessions", "expected true or false, got 1"),
    ('post_action_delay = "soon"', "post_action_delay",
     "expected a duration such as '150ms' or '2s', got 'soon'"),
    ("post_action_delay = -1", "post_action_delay", "a duration cannot be negative, got -1"),
    ("time_to_limit = 1", "time_to_limit", "expected true or false, got 1"),
    ('predict_from = "150%"', "predict_from", "must be above 0% and at most 100%, got '150%'"),
    ('predict_from = "0%"', "predict_from", "must be above 0% and at most 100%, got '0%'"),
    ('predict_from = "half"', "predict_from", "expected a percentage such as '85%', got 'half'"),
    ('freeze_deadline = "1 week"', "freeze_deadline",
     "expected a duration such as '150ms' or '2s', got '1 week'"),
    ("freeze_deadline = nan", "freeze_deadline", "a duration must be a finite number, got nan"),
    ('park_deadline = "500ms"', "park_deadline",
     "must be from 1s to 1h, got '500ms'"),
    ('park_deadline = "2h"', "park_deadline",
     "must be from 1s to 1h, got '2h'"),
    ("park_deadline = 0", "park_deadline",
     "must be from 1s to 1h, got 0"),
    ('park_deadline = "never"', "park_deadline",
     "expected a duration such as '150ms' or '2s', got 'never'"),
    ("kill_grace = true", "kill_grace",
     "expected a duration such as '150ms' or '2s', got True"),
    ('store_margin = "lots"', "store_margin",
     "expected a size such as '512M' or '2GiB', got 'lots'"),
    ("store_margin = -5", "store_margin", "a size cannot be negative, got -5"),
    ('auto_restore = "on"', "auto_restore", "expected true or false, got 'on'"),
    ('restore_quiet = "10 sec"', "restore_quiet",
     "expected a duration such as '150ms' or '2s', got '10 sec' (did you mean \"10s\"?)"),
    ('restore_margin = "64X"', "restore_margin",
     "expected a size such as '512M' or '2GiB', got '64X'"),
    ("restore_attempts = 0", "restore_attempts", "expected a whole number from 1 to 1000, got 0"),
    ('restore_attempts = "3"', "restore_attempts",
     "expected a whole number from 1 to 1000, got '3'"),
    ('restore_retry = "0"', "restore_retry", "must be above 0, got '0'"),
    ('victim_cgroups = "user.slice"', "victim_cgroups",
     "cgroup paths must be absolute, got 'user.slice'"),
    ('victim_cgroups = ["/a/../b"]', "victim_cgroups",
     "cgroup paths may not contain '..', got '/a/../b'"),
    ("victim_cgroups = 3", "victim_cgroups", "expected a cgroup path or a list of them, got 3"),
    ('action = ["kill"]', "action", "unknown key (did you mean 'actions'?)"),
]


@pytest.mark.parametrize(("line", "key", "reason"), BAD_GUARD,
                         ids=[f"{k}:{i}" for i, (_, k, _) in enumerate(BAD_GUARD)])
def test_guard_key_error(line: str, key: str, reason: str) -> None:
    assert only_issue(f"{GUARD}[[guard]]\ncgroup = \"/b\"\n{line}\n") == (f"guard[1].{key}", reason)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('min_available = "150%"', "must be above 0% and at most 100%, got '150%'"),
        ("min_available = 1.5", 'must be above 0% and at most 100%, got 1.5 (did you mean "1.5%"?)'),
        ('min_available = "plenty"', "expected a size such as '512M' or '2GiB', got 'plenty'"),
        ("min_available = -1", "a size cannot be negative, got -1"),
        ("min_available = true", "expected a size such as '512M' or '2GiB', got True"),
    ],
)
def test_min_available_error(line: str, reason: str) -> None:
    assert only_issue(f"{SYSTEM}{line}\n") == ("guard[0].min_available", reason)


@pytest.mark.parametrize(
    "text",
    [
        '[[guard]]\nsystem = true\ncgroups = ["/jobs/a"]\n',
        '[[guard]]\nsystem = true\ncgroup = "/jobs/a"\n',
        '[[guard]]\ncgroup = "/jobs/a"\ncgroups = ["/jobs/b"]\nsystem = true\n',
    ],
    ids=["cgroups", "cgroup", "both"],
)
def test_system_rule_takes_no_cgroups(text: str) -> None:
    assert only_issue(text) == ("guard[0].system", "a system-wide rule takes no cgroups")


def test_system_rule_with_an_empty_cgroup_list() -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text("[[guard]]\ncgroups = []\nsystem = true\n", SOURCE)
    assert {(i.key, i.reason) for i in info.value.issues} == {
        ("guard[0].system", "a system-wide rule takes no cgroups"),
        ("guard[0].cgroups", "empty: no cgroup to guard"),
    }


def test_system_must_be_a_bool() -> None:
    assert only_issue('[[guard]]\ncgroup = "/a"\nsystem = "yes"\n') == (
        "guard[0].system", "expected true or false, got 'yes'")


@pytest.mark.parametrize(
    ("line", "key", "reason"),
    [
        ('socket = ""', "socket", "expected a non-empty string, got ''"),
        ("socket = 5", "socket", "expected a non-empty string, got 5"),
        ('store_max_size = "big"', "store_max_size",
         "expected a size such as '512M' or '2GiB', got 'big'"),
        ("store_max_size = -1", "store_max_size", "a size cannot be negative, got -1"),
        ('store_max_size = "150%"', "store_max_size",
         "must be above 0% and at most 100%, got '150%'"),
        ('store_keep_free = "lots"', "store_keep_free",
         "expected a size such as '512M' or '2GiB', got 'lots'"),
        ("store_max_size = true", "store_max_size",
         "expected a size such as '512M' or '2GiB', got True"),
        ('store_max_age = "forever"', "store_max_age",
         "expected a duration such as '150ms' or '2s', got 'forever'"),
        ("store_max_age = -1", "store_max_age", "a duration cannot be negative, got -1"),
        ("store_max_age = inf", "store_max_age", "a duration must be a finite number, got inf"),
        ('freeze_deadline = "60s"', "freeze_deadline", "unknown key"),  # a guard key
    ],
)
def test_daemon_key_error(line: str, key: str, reason: str) -> None:
    assert only_issue(f"[daemon]\n{line}\n") == (f"daemon.{key}", reason)


def test_errors_in_a_file_name_file_and_dotted_key(tmp_path: Path) -> None:
    path = tmp_path / "oomguard.toml"
    path.write_text("""\
[daemon]
store_max_age = "a month"
[[guard]]
cgroup = "/jobs/a"
actions = ["kill", "checkpoint"]
[[guard]]
system = true
cgroups = ["/jobs/b"]
min_available = "lots"
prefer = "("
""")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    got = {(i.source, i.key, i.reason) for i in info.value.issues}
    assert got == {
        (str(path), "daemon.store_max_age",
         "expected a duration such as '150ms' or '2s', got 'a month'"),
        (str(path), "guard[0].actions",
         "'kill' can only be the last action: nothing runs after it"),
        (str(path), "guard[1].system", "a system-wide rule takes no cgroups"),
        (str(path), "guard[1].min_available",
         "expected a size such as '512M' or '2GiB', got 'lots'"),
        (str(path), "guard[1].prefer", regex_error("(")),
    }
    lines = str(info.value).splitlines()
    assert len(lines) == 5
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert f"{path}: guard[0].actions: 'kill' can only be the last action" in str(info.value)


# -- rule_parts ------------------------------------------------------------------------------

def test_rule_parts_defaults() -> None:
    parts = rule_parts(GuardConfig(cgroups=("/a",)))
    assert isinstance(parts, RuleParts)
    assert parts.chain == (Step(CHECKPOINT), Step(PAGEOUT))  # what CRIU cannot dump: paged out
    assert tuple(step.kind for step in parts.chain) == DEFAULT_CHAIN
    assert parts.prefs == Preferences()
    # the guard's defaults and the chain's agree
    assert parts.settings == ChainSettings()


@pytest.mark.parametrize(
    ("on_failure", "actions", "chain"),
    [
        ("thaw", (), (Step(CHECKPOINT), Step(PAGEOUT))),
        ("kill", (), (Step(CHECKPOINT), Step(PAGEOUT), Step(KILL))),
        ("kill", (Step(FREEZE), Step(CHECKPOINT)), (Step(FREEZE), Step(CHECKPOINT))),
        ("thaw", (Step(CHECKPOINT), Step(KILL)), (Step(CHECKPOINT), Step(KILL))),
        ("kill", (Step(SIGNAL, signal.SIGUSR1, 30.0),), (Step(SIGNAL, signal.SIGUSR1, 30.0),)),
    ],
    ids=["default", "on-failure-kill", "actions-win-over-kill", "actions-win-over-thaw",
         "signal-only"],
)
def test_rule_parts_chain(on_failure: str, actions: tuple[Step, ...],
                          chain: tuple[Step, ...]) -> None:
    spec = GuardConfig(cgroups=("/a",), on_failure=on_failure, actions=actions)
    assert rule_parts(spec).chain == chain


def test_rule_parts_compiles_preferences() -> None:
    spec = GuardConfig(cgroups=("/a",), prefer=("^python", "train"), avoid=("firefox",),
                       protect=("^sshd$",), protect_session_leaders=True)
    prefs = rule_parts(spec).prefs
    assert [p.pattern for p in prefs.prefer] == ["^python", "train"]
    assert [p.pattern for p in prefs.avoid] == ["firefox"]
    assert [p.pattern for p in prefs.protect] == ["^sshd$"]
    assert all(isinstance(p, re.Pattern) for p in prefs.prefer + prefs.avoid + prefs.protect)
    assert prefs.protect_session_leaders is True
    assert prefs.protect[0].search("sshd") and not prefs.protect[0].search("sshd-session")
    assert prefs.take_sessions is False
    assert rule_parts(GuardConfig(cgroups=("/a",), take_sessions=True)).prefs.take_sessions


def test_rule_parts_settings() -> None:
    spec = GuardConfig(cgroups=("/a",), freeze_deadline=12.5, kill_grace=0.5,
                       store_margin=MiB, headroom=32 * MiB)
    assert rule_parts(spec).settings == ChainSettings(freeze_deadline=12.5, kill_grace=0.5,
                                                      store_margin=MiB, headroom=32 * MiB)


def test_rule_parts_from_a_config_file() -> None:
    text = """\
[[guard]]
cgroup = "/jobs/a"
on_failure = "kill"
headroom = "16M"
kill_grace = "1s"
[[guard]]
cgroup = "/jobs/b"
on_failure = "kill"
actions = ["signal:USR1:30s", "checkpoint"]
avoid = "^make$"
freeze_deadline = "20s"
store_margin = "1G"
"""
    first, second = (rule_parts(g) for g in load_config_text(text, SOURCE).guards)
    assert first.chain == (Step(CHECKPOINT), Step(PAGEOUT), Step(KILL))
    assert first.settings == ChainSettings(kill_grace=1.0, headroom=16 * MiB)
    assert second.chain == (Step(SIGNAL, signal.SIGUSR1, 30.0), Step(CHECKPOINT))
    assert [p.pattern for p in second.prefs.avoid] == ["^make$"]
    assert second.settings == ChainSettings(freeze_deadline=20.0, store_margin=GiB)
