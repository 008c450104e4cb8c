"""Which config the CLI reads: the one the service uses, so that every subcommand finds the
daemon's socket and store. In order: `--config FILE`, `$OOMGUARD_CONFIG`, the default path
(/etc/oomguard/oomguard.toml) when it is there, else the embedded default.

A non-root user can usually not read a root-only config. When the file came from
$OOMGUARD_CONFIG or the default path (not from an explicit --config), such a user gets the
embedded default (the default socket) instead of an error; `fallback` says why."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from oomguard.config.loading import (
    DEFAULT_CONFIG_PATH,
    DaemonConfig,
    decode_config,
    load_config_text,
    load_embedded_config,
)
from oomguard.model.errors import ConfigError, ConfigIssue

CONFIG_ENV = "OOMGUARD_CONFIG"
NAMED_BY_FLAG = "--config"
NAMED_BY_ENV = f"${CONFIG_ENV}"
NAMED_BY_DEFAULT = "the default path"
NAMED_BY_NOTHING = "no config file"


@dataclass(frozen=True)
class ConfigChoice:
    """The config file the CLI reads (None: the embedded default) and what named it."""

    path: Path | None
    named_by: str


@dataclass(frozen=True)
class CliConfig:
    config: DaemonConfig
    choice: ConfigChoice
    fallback: str | None = None  # why the embedded default stands in for choice.path


def choose_config(flag: Path | None, environ: Mapping[str, str],
                  default: Path = DEFAULT_CONFIG_PATH) -> ConfigChoice:
    """--config, else $OOMGUARD_CONFIG (when set and not empty), else `default` when it is
    there (or cannot be looked at: a root-only /etc/oomguard), else the embedded default."""
    if flag is not None:
        return ConfigChoice(flag, NAMED_BY_FLAG)
    named = environ.get(CONFIG_ENV, "").strip()
    if named:
        return ConfigChoice(Path(named), NAMED_BY_ENV)
    try:
        default.stat()
    except PermissionError:
        return ConfigChoice(default, NAMED_BY_DEFAULT)
    except OSError:
        return ConfigChoice(None, NAMED_BY_NOTHING)
    return ConfigChoice(default, NAMED_BY_DEFAULT)


def merge_config_flags(global_flag: Path | None, run_flag: Path | None) -> Path | None:
    """`oomguard --config A run --config B`: the same file twice is fine, two are not."""
    if global_flag is not None and run_flag is not None and global_flag != run_flag:
        raise ConfigError([ConfigIssue("command line", "--config",
                                       f"given twice ({global_flag} and {run_flag})")])
    return run_flag if run_flag is not None else global_flag


def _read(path: Path) -> str:
    return decode_config(path.read_bytes(), str(path))


def load_cli_config(choice: ConfigChoice, euid: int,
                    read: Callable[[Path], str] = _read) -> CliConfig:
    """The chosen config, validated (ConfigError naming the file and every bad key)."""
    if choice.path is None:
        return CliConfig(load_embedded_config(), choice)
    source = str(choice.path)
    try:
        text = read(choice.path)
    except PermissionError as exc:
        if euid != 0 and choice.named_by != NAMED_BY_FLAG:
            return CliConfig(load_embedded_config(), choice,
                             fallback=f"{source} ({choice.named_by}): {exc.strerror}")
        raise ConfigError([ConfigIssue(source, "(file)", _cannot_read(exc, choice))]) from exc
    except OSError as exc:
        raise ConfigError([ConfigIssue(source, "(file)", _cannot_read(exc, choice))]) from exc
    return CliConfig(load_config_text(text, source), choice)


def _cannot_read(exc: OSError, choice: ConfigChoice) -> str:
    reason = f"cannot read: {exc.strerror or exc}"
    return f"{reason} (named by {CONFIG_ENV})" if choice.named_by == NAMED_BY_ENV else reason


def discover_cli_config(global_flag: Path | None, run_flag: Path | None = None,
                        environ: Mapping[str, str] | None = None,
                        euid: int | None = None) -> CliConfig:
    """What every subcommand starts from: the flags, the environment, the default path."""
    flag = merge_config_flags(global_flag, run_flag)
    choice = choose_config(flag, os.environ if environ is None else environ)
    return load_cli_config(choice, os.geteuid() if euid is None else euid)
