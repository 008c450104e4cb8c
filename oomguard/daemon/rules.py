"""The rules in force: the daemon's config, the guards its rules make (the system rule's, and a
cgroup guard for each cgroup a rule names or its glob matches), and the config read again on
SIGHUP: checked, and claimed, before it replaces the running one; any error rejects it whole."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from oomguard.cgroup.configchecks import check_config
from oomguard.cgroup.mounts import CgroupLayout
from oomguard.config.loading import DaemonConfig, load_config
from oomguard.daemon.cgroupguards import CgroupGuards
from oomguard.daemon.guardarming import GuardArming
from oomguard.daemon.guardlines import guard_line
from oomguard.daemon.guards import CgroupGuard, Guard, SystemGuard, arm_system
from oomguard.daemon.registrations import Registrations
from oomguard.model.errors import ConfigError, ConfigIssue, OomguardError
from oomguard.respond.actor import rule_parts

RESTART_KEYS = ("store", "socket", "criu", "nice")  # a reload keeps the running ones


class Rules:
    """Owns the config in force (`config`), the system rule's guard (`system_guards`: at most
    one) and the app's two reload hooks: `claim` checks a reload's rules before they replace the
    running ones (the new cgroups' locks: LockHeld where another daemon guards one) and
    `on_reload` is told the new config (the hooks). Shares every guard (`guards`) with the
    Daemon and the cgroup guards, emptied in place."""

    def __init__(self, config: DaemonConfig, *, layout: CgroupLayout, log: Any,
                 meminfo: Callable[[], Any], psi_trigger: str, guards: list[Guard],
                 cgroup_guards: CgroupGuards, arming: GuardArming,
                 registrations: Registrations) -> None:
        self.config = config
        self.layout = layout
        self.log = log
        self.meminfo = meminfo
        self.psi_trigger = psi_trigger
        self.guards = guards
        self.cgroup_guards = cgroup_guards
        self.arming = arming
        self.registrations = registrations
        self.system_guards: list[SystemGuard] = []
        self.claim: Callable[[DaemonConfig], None] = lambda new: None
        self.on_reload: Callable[[DaemonConfig], None] = lambda new: None

    def build_guards(self) -> None:
        fixed: list[CgroupGuard] = []
        for spec in self.config.guards:
            if spec.system:
                system = SystemGuard(spec=spec)
                system.parts = rule_parts(spec)
                self.guards.append(system)
                self.system_guards.append(system)
                arm_system(system, self.psi_trigger)
                self.registrations.register(system)
                self.log.info("guard.armed", cgroup="system", detection=system.detection,
                              min_available=spec.min_available,
                              summary=guard_line(system, None, self.meminfo().total,
                                                 self.config.dry_run))
                continue
            for path in spec.cgroups:
                if glob.has_magic(path):
                    self.cgroup_guards.globs.append((spec, path))
                    continue
                fixed.append(self.cgroup_guards.new_guard(spec, path))
        # Where cgroups appear is watched before the globs are read: one made in between
        # (a scheduler's next job, while the daemon starts) is reported, not missed until the
        # next rescan (the v2 lane caught it).
        self.cgroup_guards.watch_directories()
        self.arming.arm(fixed + self.cgroup_guards.glob_matches())  # one batch: see arming.py
        self.cgroup_guards.watch_directories()

    def warn(self, warnings: list[ConfigIssue]) -> None:
        """What check-config prints as warnings: the rules run, the mistake is logged."""
        for issue in warnings:
            self.log.warning("config.warning", source=issue.source, key=issue.key,
                             reason=issue.reason)

    def reload(self, release: Callable[[], None], apply: Callable[[DaemonConfig], None]) -> bool:
        """SIGHUP: read the config file again. A config with any error is rejected, every error
        logged, and the running rules stay (False); a good one replaces the rules: the running
        guards are let go (`release`), the new config handed to the daemon's parts (`apply`)
        and the app's hooks, and its guards built (True)."""
        source = self.config.source
        new = self._read_again(source)
        if new is None:
            return False
        release()
        self.guards.clear()  # shared with the cgroup guards: emptied in place
        self.system_guards = []
        self.registrations.forget()
        self.cgroup_guards.forget_rules()
        self.config = replace(new, store=self.config.store, state_dir=self.config.state_dir,
                              socket=self.config.socket,
                              criu=self.config.criu, nice=self.config.nice)
        apply(self.config)
        self.on_reload(self.config)
        self.log.info("config.reloaded", source=source, guards=len(new.guards),
                      hooks=[event for event, _ in new.hooks] or None)
        self.build_guards()
        return True

    def _read_again(self, source: str) -> DaemonConfig | None:
        """The config file read, checked and claimed, its warnings logged; None (said why)
        where it is rejected or the rules did not come from a file."""
        if not os.path.isfile(source):
            self.log.warning("config.reload_ignored", source=source,
                             explanation="rules came from the command line, not a file")
            return None
        try:
            new = load_config(source)
            warnings = check_config(new, self.layout)
            self.claim(new)
        except ConfigError as exc:
            issues = [str(i) for i in exc.issues]
            self.log.error("config.rejected", source=source, issues=issues,
                           explanation="the running rules stay in force")
            return None
        except (OomguardError, OSError) as exc:  # LockHeld: another daemon guards one of them
            self.log.error("config.rejected", source=source, issues=[str(exc)],
                           explanation="the running rules stay in force")
            return None
        for key in RESTART_KEYS:
            if getattr(new, key) != getattr(self.config, key):
                self.log.warning("config.restart_needed", key=f"daemon.{key}",
                                 explanation="this setting takes effect at the next start")
        self.warn(warnings)
        return new
