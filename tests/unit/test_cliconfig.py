"""Which config the CLI reads: --config, $OOMGUARD_CONFIG, the default path, the embedded
default; and what a non-root user gets when the file is root-only."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from oomguard.config.discovery import (
    NAMED_BY_DEFAULT,
    NAMED_BY_ENV,
    NAMED_BY_FLAG,
    NAMED_BY_NOTHING,
    ConfigChoice,
    choose_config,
    load_cli_config,
    merge_config_flags,
)
from oomguard.config.loading import EMBEDDED_CONFIG
from oomguard.model.errors import ConfigError

CUSTOM = '[daemon]\nsocket = "/tmp/og-unit/control.sock"\nstore = "/tmp/og-unit/store"\n'


@pytest.fixture
def default(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "oomguard.toml"
    path.parent.mkdir()
    path.write_text(CUSTOM)
    return path


def test_the_flag_comes_before_the_environment_and_the_default(default: Path,
                                                              tmp_path: Path) -> None:
    flag = tmp_path / "flag.toml"
    env = {"OOMGUARD_CONFIG": str(tmp_path / "env.toml")}
    assert choose_config(flag, env, default) == ConfigChoice(flag, NAMED_BY_FLAG)


def test_the_environment_comes_before_the_default(default: Path, tmp_path: Path) -> None:
    named = tmp_path / "env.toml"
    assert choose_config(None, {"OOMGUARD_CONFIG": str(named)}, default) == \
        ConfigChoice(named, NAMED_BY_ENV)
    # Set but empty counts as not set.
    assert choose_config(None, {"OOMGUARD_CONFIG": ""}, default) == \
        ConfigChoice(default, NAMED_BY_DEFAULT)


def test_the_default_path_when_present_else_the_embedded_default(default: Path) -> None:
    assert choose_config(None, {}, default) == ConfigChoice(default, NAMED_BY_DEFAULT)
    default.unlink()
    assert choose_config(None, {}, default) == ConfigChoice(None, NAMED_BY_NOTHING)


def test_the_chosen_file_is_what_is_loaded(default: Path) -> None:
    found = load_cli_config(ConfigChoice(default, NAMED_BY_DEFAULT), euid=0)
    assert found.config.socket == Path("/tmp/og-unit/control.sock")
    assert found.config.store == Path("/tmp/og-unit/store")
    assert found.config.source == str(default) and found.fallback is None
    embedded = load_cli_config(ConfigChoice(None, NAMED_BY_NOTHING), euid=0)
    assert embedded.config.source == EMBEDDED_CONFIG
    assert embedded.config.socket == Path("/run/oomguard/control.sock")


def test_run_config_and_global_config_agree_or_are_refused(tmp_path: Path) -> None:
    one, other = tmp_path / "one.toml", tmp_path / "other.toml"
    assert merge_config_flags(one, None) == one
    assert merge_config_flags(None, other) == other
    assert merge_config_flags(one, one) == one
    assert merge_config_flags(None, None) is None
    with pytest.raises(ConfigError) as caught:
        merge_config_flags(one, other)
    assert caught.value.issues[0].key == "--config"


def _denied(path: Path) -> str:
    raise PermissionError(errno.EACCES, "Permission denied", str(path))


@pytest.mark.parametrize("named_by", [NAMED_BY_ENV, NAMED_BY_DEFAULT])
def test_a_root_only_config_gives_a_user_the_default_socket(default: Path, named_by: str) -> None:
    found = load_cli_config(ConfigChoice(default, named_by), euid=1000, read=_denied)
    assert found.config.socket == Path("/run/oomguard/control.sock")
    assert found.fallback is not None and str(default) in found.fallback


def test_an_unreadable_config_named_on_the_command_line_is_an_error(default: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_cli_config(ConfigChoice(default, NAMED_BY_FLAG), euid=1000, read=_denied)
    (issue,) = caught.value.issues
    assert issue.source == str(default) and "Permission denied" in issue.reason
    # root is never denied by file modes: a refusal is a real error.
    with pytest.raises(ConfigError):
        load_cli_config(ConfigChoice(default, NAMED_BY_DEFAULT), euid=0, read=_denied)


def test_a_missing_file_named_by_the_environment_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as caught:
        load_cli_config(ConfigChoice(missing, NAMED_BY_ENV), euid=1000)
    (issue,) = caught.value.issues
    assert issue.source == str(missing) and issue.key == "(file)"
    assert "OOMGUARD_CONFIG" in issue.reason


def test_a_bad_key_names_the_file_and_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\npoll_interval = "fast"\n')
    with pytest.raises(ConfigError) as caught:
        load_cli_config(ConfigChoice(bad, NAMED_BY_ENV), euid=1000)
    assert [(i.source, i.key) for i in caught.value.issues] == \
        [(str(bad), "daemon.poll_interval")]
