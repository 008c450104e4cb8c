"""The `oomguard` command line. Exit status: 0 done, 1 the operation failed, 2 bad input.

The commands on checkpoints and paged-out trees are in storecommands.py; what every command
shares (exit statuses, the config, the backend) in commandbase.py."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

from oomguard.cli.commandbase import EXIT_FAILED, EXIT_OK, EXIT_USAGE, _base_config, _call, _cli_config
from oomguard.cli.parser import build_parser
from oomguard.cli.storecommands import (
    cmd_attach,
    cmd_checkpoint,
    cmd_forget,
    cmd_gpu_resume,
    cmd_list,
    cmd_restore,
    cmd_resume,
    cmd_resume_job,
    cmd_show,
    cmd_status,
)
from oomguard.config.discovery import choose_config
from oomguard.config.loading import EMBEDDED_CONFIG, load_config, load_embedded_config, parse_config
from oomguard.control.client import ControlError
from oomguard.control.protocol import ERROR_AMBIGUOUS
from oomguard.model.errors import (
    AmbiguousId,
    BadInput,
    CheckpointFailed,
    ConfigError,
    ConfigIssue,
    CriuError,
    OomguardError,
    ProcessGone,
    RestoreFailed,
    StoreError,
)
from oomguard.observe.logsetup import configure_logging, get_logger

# Subcommands that read no config, or (check-config) name their own file.
OWN_CONFIG_COMMANDS = ("check-config", "install-units", "notify-agent")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level, lazily=True)
    handler = COMMANDS[args.command]
    try:
        if args.command not in OWN_CONFIG_COMMANDS:  # a bad config stops them all, up front
            args.cli_config = _cli_config(args)
        return int(handler(args))
    except ConfigError as exc:
        for issue in exc.issues:
            print(f"oomguard: config error: {issue}", file=sys.stderr)
        return EXIT_USAGE
    except (AmbiguousId, BadInput) as exc:
        print(f"oomguard: {args.command}: {exc}" if isinstance(exc, BadInput)
              else f"oomguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ControlError as exc:
        print(f"oomguard: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.name == ERROR_AMBIGUOUS else EXIT_FAILED
    except (RestoreFailed, StoreError, CheckpointFailed, CriuError, ProcessGone) as exc:
        print(f"oomguard: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OomguardError as exc:
        print(f"oomguard: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


# -- helpers -------------------------------------------------------------------------------------

def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise OomguardError(f"{what} needs root (checkpoints are root-only: they hold every "
                            "secret of the process)")


# -- commands ------------------------------------------------------------------------------------

def _flag_name(key: str) -> str:
    """guard[0].time_to_limit -> --time-to-limit (the flag that set it)."""
    name = key.split(".", 1)[-1]
    return "--cgroup" if name == "cgroups" else "--" + name.replace("_", "-")


def cmd_run(args: argparse.Namespace) -> int:
    from oomguard.cgroup.configchecks import check_cgroup_paths
    from oomguard.cgroup.mounts import read_layout
    from oomguard.daemon.locks import held_for

    config = _base_config(args)
    if args.cgroup:
        flags = {"cgroups": args.cgroup, "threshold": args.threshold,
                 "on_failure": args.on_failure, "events": not args.no_events,
                 "auto_restore": args.auto_restore, "time_to_limit": args.time_to_limit,
                 "prefer": args.prefer, "avoid": args.avoid, "protect": args.protect}
        if args.actions:
            flags["actions"] = args.actions.split(",")
        # The flags go through the config parser: the same rules, the same error messages,
        # told by flag name.
        try:
            guard = parse_config({"guard": [flags]}, "command line").guards[0]
        except ConfigError as exc:
            raise ConfigError([ConfigIssue(i.source, _flag_name(i.key), i.reason)
                               for i in exc.issues]) from None
        config = replace(config, guards=(guard,), source="command line")
    if args.poll_interval is not None:
        config = replace(config, poll_interval=args.poll_interval)
    if args.dry_run:
        config = replace(config, dry_run=True)
    if args.socket is not None:
        config = replace(config, socket=args.socket)
    _need_root("oomguard run")
    # This node's records: in the store, unless other nodes share it (store/nodestate.py).
    from oomguard.store.nodestate import node_state

    config = replace(config, state_dir=node_state(config.store, config.state_dir).path)
    layout = read_layout()
    check_cgroup_paths(config, layout, "--cgroup" if args.cgroup else None)
    # One daemon per store and per cgroup: a second one refuses here, before the daemon's
    # parts are loaded or anything is written (its settings, socket, ledger, standby).
    with held_for(config, layout) as locks:
        from oomguard.daemon.serve import run_daemon

        return run_daemon(config, get_logger(), layout, locks)


def cmd_exec(args: argparse.Namespace) -> int:
    from oomguard.terminal.commands import run_exec

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        print("oomguard: exec: no command given (oomguard exec -- CMD ...)", file=sys.stderr)
        return EXIT_USAGE
    procs = None
    if args.cgroup:
        from oomguard.cgroup.mounts import open_cgroup, read_layout
        try:  # the job's init joins it; this process (not dumped) stays where it is
            cgroup = open_cgroup(args.cgroup, read_layout())
        except ValueError as exc:
            print(f"oomguard: exec: --cgroup: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if not cgroup.exists():
            print(f"oomguard: exec: --cgroup: no such memory cgroup: {cgroup.path}",
                  file=sys.stderr)
            return EXIT_USAGE
        procs = cgroup.path / "cgroup.procs"
    return run_exec(command, procs, lambda method, **p: _call(args, method, **p))


def cmd_doctor(args: argparse.Namespace) -> int:
    from oomguard.cli.doctorconfig import doctor_checks

    checks = doctor_checks(_base_config(args), args.cli_config, args.socket)
    for check in checks:
        print(check.line())
    return EXIT_OK if all(c.ok or c.warn_only for c in checks) else EXIT_FAILED


def cmd_notify_agent(args: argparse.Namespace) -> int:
    from oomguard.observe.notifyagent import NotificationAgent, NotificationError

    log = get_logger()
    while True:
        try:
            with NotificationAgent(args.system_bus, args.session_bus) as agent:
                log.info("agent.started", uid=os.getuid())
                agent.run()
        except (NotificationError, OSError) as exc:
            log.warning("agent.retry", error=str(exc), retry_in_s=5)
            time.sleep(5)


def cmd_install_units(args: argparse.Namespace) -> int:
    from oomguard.cli.install_units import existing_config, install_units, report

    before = existing_config(args.config_dir)  # a bad one: exit 2 before anything is written
    try:
        done = install_units(args.unit_dir, args.config_dir, user_unit_dir=args.user_unit_dir)
    except OSError as exc:
        print(f"oomguard: install-units: {exc.filename}: {exc.strerror}"
              + (" (run it as root)" if os.geteuid() != 0 else ""), file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(report(done, len(before.guards) if before is not None else 0)))
    return EXIT_OK


def cmd_check_config(args: argparse.Namespace) -> int:
    from oomguard.cgroup.configchecks import check_config
    from oomguard.cgroup.mounts import read_layout

    if args.file is None:  # the config every other subcommand reads
        args.file = choose_config(args.global_config, os.environ).path
    config = load_config(args.file) if args.file is not None else load_embedded_config()
    # The daemon's start and reload run the same checks: errors refuse, warnings are logged.
    for issue in check_config(config, read_layout()):
        print(f"warning: {issue}", file=sys.stderr)
    print(f"{args.file or EMBEDDED_CONFIG}: OK ({len(config.guards)} guard rule(s))")
    return EXIT_OK


COMMANDS: dict[str, Any] = {
    "run": cmd_run, "checkpoint": cmd_checkpoint, "list": cmd_list, "show": cmd_show,
    "status": cmd_status,
    "restore": cmd_restore, "forget": cmd_forget, "exec": cmd_exec, "doctor": cmd_doctor,
    "check-config": cmd_check_config, "install-units": cmd_install_units,
    "notify-agent": cmd_notify_agent, "gpu-resume": cmd_gpu_resume, "resume": cmd_resume,
    "resume-job": cmd_resume_job, "attach": cmd_attach,
}
