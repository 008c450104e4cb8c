"""`oomguard run`: wire the real parts together and run the guard loop and the control socket."""

from __future__ import annotations

from typing import Any

from oomguard import __version__
from oomguard.cgroup.mounts import open_cgroup, read_layout
from oomguard.config import DaemonConfig
from oomguard.control.server import ControlServer
from oomguard.daemon import Daemon
from oomguard.errors import ConfigError, ConfigIssue
from oomguard.freezer import SigstopFreezer
from oomguard.logsetup import RecordingLogger
from oomguard.procfs import ProcReader
from oomguard.restore import Restorer
from oomguard.store import Store
from oomguard.wiring import build_checkpointer, build_criu, build_service, remove_criu_cgroup


def check_cgroup_paths(config: DaemonConfig, flag_name: str | None) -> None:
    layout = read_layout()
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


def run_daemon(config: DaemonConfig, base_log: Any) -> int:
    log = RecordingLogger(base_log)
    layout = read_layout()
    proc = ProcReader()
    criu = build_criu(config.criu, layout, proc)
    checkpointer = build_checkpointer(config, criu, proc)
    restorer = Restorer(criu, Store(config.store), SigstopFreezer(proc), proc)
    daemon = Daemon(config, checkpointer, layout, log, proc=proc, restorer=restorer)
    daemon.install_signal_handlers()
    server = None
    try:
        service = build_service(config, layout, proc, checkpointer=checkpointer,
                                status=daemon.status)
        service.restorer = restorer
        server = ControlServer(config.socket, service, note=log.info)
        server.start()
    except OSError as exc:
        log.warning("control.unavailable", socket=str(config.socket), error=str(exc),
                    explanation="the CLI falls back to direct access (root only)")
    log.info("guard.started", version=__version__, config=config.source, store=str(config.store),
             socket=str(config.socket) if server else None, criu=criu.binary,
             criu_version=".".join(map(str, criu.version)), cgroup_mode=layout.mode,
             guards=len(config.guards), dry_run=config.dry_run)
    if not config.guards:
        log.warning("guard.idle", explanation="no [[guard]] rules: nothing is watched; add one "
                    "to the config or pass --cgroup")
    try:
        daemon.arm()
        daemon.run()
    finally:
        if server is not None:
            server.stop()
        daemon.close()
        remove_criu_cgroup(layout, proc)
        log.info("guard.stopped")
    return 0
