"""A parsed configuration checked against this machine: the same checks for `check-config`,
the daemon's start and its SIGHUP reload.

An error (a cgroup path outside the memory hierarchy) raises ConfigError; a warning (a cgroup
that does not exist yet, a size of a few bytes) is returned: the daemon logs it and runs.
"""

from __future__ import annotations

import glob

from oomguard.cgroup.mounts import CgroupLayout, open_cgroup
from oomguard.config.schema import DaemonConfig
from oomguard.model.errors import ConfigError, ConfigIssue


def check_cgroup_paths(config: DaemonConfig, layout: CgroupLayout,
                       flag_name: str | None = None) -> None:
    """Every guard's cgroup lies in the memory hierarchy (ConfigError with file and key)."""
    issues = []
    for index, guard in enumerate(config.guards):
        for path in guard.cgroups:
            try:
                open_cgroup(path, layout)
            except ValueError as exc:
                where = flag_name or f"guard[{index}].cgroups"
                issues.append(ConfigIssue(config.source, where, str(exc)))
    if issues:
        raise ConfigError(issues)


def missing_cgroups(config: DaemonConfig, layout: CgroupLayout) -> list[ConfigIssue]:
    """A warning per guarded cgroup (not a glob) that does not exist now: the rule guards it
    once it is created, but a typo in the path would leave it unguarded for good."""
    issues = []
    for index, guard in enumerate(config.guards):
        if guard.cgroups and layout.memory_mount is None:
            issues.append(ConfigIssue(config.source, f"guard[{index}].cgroups",
                                      "not checked: this machine has no memory cgroup "
                                      "controller mounted"))
            continue
        for path in guard.cgroups:
            if glob.has_magic(path):
                continue
            try:
                cgroup = open_cgroup(path, layout)
            except ValueError:
                continue  # an error, reported by check_cgroup_paths
            if not cgroup.exists():
                issues.append(ConfigIssue(
                    config.source, f"guard[{index}].cgroups",
                    f"cgroup {cgroup.path} does not exist (guarded once it is created)"))
    return issues


def config_warnings(config: DaemonConfig, layout: CgroupLayout) -> list[ConfigIssue]:
    """What parsed but looks like a mistake, and cgroups that are not there."""
    return [*config.warnings, *missing_cgroups(config, layout)]


def check_config(config: DaemonConfig, layout: CgroupLayout,
                 flag_name: str | None = None) -> list[ConfigIssue]:
    """Raise ConfigError for errors against this machine; return the warnings. On a machine
    without a memory controller (a CI container checking a file for another host) the
    cgroups are not checked: a warning says so."""
    if layout.memory_mount is not None:
        check_cgroup_paths(config, layout, flag_name)
    return config_warnings(config, layout)
