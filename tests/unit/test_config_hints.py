"""check-config helps: a bare number gets the unit it lacked, an unknown key the nearest known
one, a misspelt choice the nearest choice; a size of a few bytes and a cgroup that is not there
are warnings, not errors (oomguard.config.values, oomguard.cgroup.configchecks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.cgroup.configchecks import check_config, config_warnings
from oomguard.cgroup.mounts import CgroupLayout
from oomguard.config.loading import load_config_text
from oomguard.model.errors import ConfigError, ConfigIssue

GUARD = '[[guard]]\ncgroup = "/a"\n'
SYSTEM = "[[guard]]\nsystem = true\n"


def only_issue(text: str) -> ConfigIssue:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "/etc/oomguard/hints.toml")
    [issue] = caught.value.issues
    assert issue.source == "/etc/oomguard/hints.toml"
    return issue


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        # shares: a bare number is a fraction (0.85 is fine), so 85 is past 100%
        (GUARD + "threshold = 85\n", "guard[0].threshold", '(did you mean "85%"?)'),
        (GUARD + 'threshold = "85"\n', "guard[0].threshold", '(did you mean "85%"?)'),
        (GUARD + "threshold = 85.5\n", "guard[0].threshold", '(did you mean "85.5%"?)'),
        (GUARD + 'threshold = "85 percent"\n', "guard[0].threshold", '(did you mean "85%"?)'),
        (GUARD + "predict_from = 50\n", "guard[0].predict_from", '(did you mean "50%"?)'),
        (GUARD + "gpu_threshold = 95\n", "guard[0].gpu_threshold", '(did you mean "95%"?)'),
        (SYSTEM + "psi_full_avg10 = 60\n", "guard[0].psi_full_avg10", '(did you mean "60%"?)'),
        (SYSTEM + "min_available = 1.5\n", "guard[0].min_available", '(did you mean "1.5%"?)'),
        # sizes: a bare number is bytes; refused when below the key's floor
        ('[criu]\ncgroup_limit = 256\n', "criu.cgroup_limit", '(did you mean "256M"?)'),
        (GUARD + 'headroom = "512 megs"\n', "guard[0].headroom", '(did you mean "512M"?)'),
        ('[gpu]\nhost_margin = "2 gigs"\n', "gpu.host_margin", '(did you mean "2G"?)'),
        # durations: a unit word the parser does not know; seconds meant as milliseconds
        (GUARD + 'kill_grace = "30 sec"\n', "guard[0].kill_grace", '(did you mean "30s"?)'),
        (GUARD + 'restore_quiet = "5 minutes"\n', "guard[0].restore_quiet", '(did you mean "5m"?)'),
        ('[daemon]\nstore_max_age = "30 days"\n', "daemon.store_max_age", '(did you mean "30d"?)'),
        (GUARD + "post_action_delay = 100000\n", "guard[0].post_action_delay",
         '(did you mean "100000ms"?)'),
        # unknown keys: the nearest known key of the same table
        (GUARD + 'treshold = "85%"\n', "guard[0].treshold",
         "unknown key (did you mean 'threshold'?)"),
        (GUARD + 'action = ["kill"]\n', "guard[0].action", "unknown key (did you mean 'actions'?)"),
        (GUARD + GUARD + 'cgroupz = "/b"\n', "guard[1].cgroupz",
         "unknown key (did you mean 'cgroup'?)"),
        ('[daemon]\nrescan_intervall = "2s"\n', "daemon.rescan_intervall",
         "unknown key (did you mean 'rescan_interval'?)"),
        ('[deamon]\ndry_run = true\n', "deamon", "unknown key (did you mean 'daemon'?)"),
        ('[hook]\ntimeout = "5s"\n', "hook", "unknown key (did you mean 'hooks'?)"),
        ('[hooks]\non_checkpont = "true"\n', "hooks.on_checkpont",
         "unknown key (did you mean 'on_checkpoint'?)"),
        # choices
        (GUARD + 'on_failure = "thwa"\n', "guard[0].on_failure", "(did you mean 'thaw'?)"),
        (GUARD + 'gpu = "avod"\n', "guard[0].gpu", "(did you mean 'avoid'?)"),
        ('[slurm]\nafter_checkpoint = "requeu"\n', "slurm.after_checkpoint",
         "(did you mean 'requeue'?)"),
    ],
    ids=lambda v: v if isinstance(v, str) and "\n" not in v and len(v) < 30 else None,
)
def test_a_refused_value_gets_a_hint(text: str, key: str, hint: str) -> None:
    issue = only_issue(text)
    assert issue.key == key
    assert issue.reason.endswith(hint), issue.reason


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (GUARD + "threshold = 150\n", "must be above 0% and at most 100%, got 150"),
        (GUARD + 'threshold = "150%"\n', "must be above 0% and at most 100%, got '150%'"),
        (GUARD + "threshold = 0\n", "must be above 0% and at most 100%, got 0"),
        (GUARD + 'headroom = "3P"\n', "must be from 0B to 1024.0TiB, got '3P'"),
        (GUARD + 'headroom = "64X"\n', "expected a size such as '512M' or '2GiB', got '64X'"),
        (GUARD + "headroom = -5\n", "a size cannot be negative, got -5"),
        (GUARD + 'kill_grace = "1 week"\n',
         "expected a duration such as '150ms' or '2s', got '1 week'"),
        (GUARD + "park_deadline = 0.5\n", "must be from 1s to 1h, got 0.5"),
        (GUARD + 'threshold = "high"\n', "expected a percentage such as '85%', got 'high'"),
        (GUARD + 'frobnicate = 1\n', "unknown key"),
        ('[gpu]\nengine = "xyz"\n',
         "expected one of 'auto', 'cuda-checkpoint', 'criu-plugin', 'off', got 'xyz'"),
    ],
    ids=lambda v: v if isinstance(v, str) and "\n" not in v and len(v) < 30 else None,
)
def test_no_guess_where_a_unit_would_not_help(text: str, reason: str) -> None:
    """Out of bounds as written ("150%", "3P"), or a unit no known one starts like: no hint."""
    assert only_issue(text).reason == reason


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        (GUARD + "headroom = 64\n", "guard[0].headroom", '64 bytes (did you mean "64M"?)'),
        (GUARD + 'store_margin = "512"\n', "guard[0].store_margin",
         '512 bytes (did you mean "512M"?)'),
        ('[daemon]\nstore_max_size = 100\n', "daemon.store_max_size",
         '100 bytes (did you mean "100M"?)'),
        (SYSTEM + "min_available = 10\n", "guard[0].min_available",
         '10 bytes (did you mean "10%"?)'),
    ],
)
def test_a_size_of_a_few_bytes_is_a_warning(text: str, key: str, reason: str) -> None:
    config = load_config_text(text, "tiny.toml")  # accepted: bytes are a size
    assert config.warnings == (ConfigIssue("tiny.toml", key, reason),)


@pytest.mark.parametrize(
    "line",
    ["headroom = 4096", 'headroom = "64M"', "store_margin = 0", "threshold = 0.85",
     'threshold = "85%"', "kill_grace = 5", 'restore_quiet = "10"'],
)
def test_plain_values_raise_no_warning(line: str) -> None:
    assert load_config_text(f"{GUARD}{line}\n", "plain.toml").warnings == ()


def test_every_issue_names_file_key_and_guard_index() -> None:
    text = (GUARD + GUARD + 'treshold = "85%"\nthreshold = 85\n[daemon]\npoll_interval = "1 sec"\n')
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "/srv/many.toml")
    lines = str(caught.value).splitlines()
    assert lines == [
        "/srv/many.toml: daemon.poll_interval: expected a duration such as '150ms' or '2s', "
        "got '1 sec' (did you mean \"1s\"?)",
        "/srv/many.toml: guard[1].threshold: must be above 0% and at most 100%, got 85 "
        "(did you mean \"85%\"?)",
        "/srv/many.toml: guard[1].treshold: unknown key (did you mean 'threshold'?)",
    ]


# -- against the machine: a memory hierarchy laid out in a directory --------------------------

def _v1_hierarchy(root: Path, *cgroups: str) -> CgroupLayout:
    for name in cgroups:
        (root / name).mkdir(parents=True)
        (root / name / "memory.usage_in_bytes").write_text("0\n")
    return CgroupLayout(memory_v1=root, unified=None, unified_controllers=())


def test_a_missing_cgroup_is_a_warning_with_its_path(tmp_path: Path) -> None:
    layout = _v1_hierarchy(tmp_path, "jobs/a")
    text = (f'[[guard]]\ncgroups = ["/jobs/a", "/jobs/b", "/slurm/uid_*/job_*"]\n'
            f'[[guard]]\ncgroup = "{tmp_path}/jobs/c"\n[[guard]]\nsystem = true\n')
    config = load_config_text(text, "paths.toml")
    assert check_config(config, layout) == [
        ConfigIssue("paths.toml", "guard[0].cgroups",
                    f"cgroup {tmp_path}/jobs/b does not exist (guarded once it is created)"),
        ConfigIssue("paths.toml", "guard[1].cgroups",
                    f"cgroup {tmp_path}/jobs/c does not exist (guarded once it is created)"),
    ]


def test_parse_warnings_and_missing_cgroups_come_together(tmp_path: Path) -> None:
    layout = _v1_hierarchy(tmp_path)
    config = load_config_text('[[guard]]\ncgroup = "/gone"\nheadroom = 8\n', "both.toml")
    assert [(i.key, i.reason.split(" (")[0]) for i in config_warnings(config, layout)] == [
        ("guard[0].headroom", "8 bytes"),
        ("guard[0].cgroups", f"cgroup {tmp_path}/gone does not exist"),
    ]


def test_without_a_memory_controller_cgroups_are_not_checked() -> None:
    layout = CgroupLayout(memory_v1=None, unified=None, unified_controllers=())
    config = load_config_text('[[guard]]\ncgroup = "/jobs/a"\n', "ci.toml")
    assert check_config(config, layout) == [
        ConfigIssue("ci.toml", "guard[0].cgroups",
                    "not checked: this machine has no memory cgroup controller mounted")]

