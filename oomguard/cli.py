"""The `oomguard` command line. Exit status: 0 done, 1 the operation failed, 2 bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from oomguard import __version__
from oomguard.cgroup.mounts import open_cgroup, read_layout
from oomguard.checkpoint import ON_FAILURE_KILL, ON_FAILURE_THAW, tree_of
from oomguard.config import (
    DEFAULT_CONFIG_PATH,
    DaemonConfig,
    GuardConfig,
    load_config,
    load_embedded_config,
)
from oomguard.errors import (
    CheckpointFailed,
    ConfigError,
    ConfigIssue,
    CriuError,
    OomguardError,
    ProcessGone,
    RestoreFailed,
    StoreError,
)
from oomguard.logsetup import configure_logging, get_logger
from oomguard.procfs import ProcReader
from oomguard.store import Store
from oomguard.units import format_size, parse_duration, parse_fraction

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _fraction_arg(text: str) -> float:
    try:
        return parse_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oomguard", description="Checkpoint (CRIU) the top memory consumer of a cgroup "
        "near its limit instead of letting the OOM killer run.")
    parser.add_argument("--version", action="version", version=f"oomguard {__version__}")
    parser.add_argument("--store", type=Path, help="checkpoint store (default /var/lib/oomguard)")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default="info")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="guard cgroups (the daemon)")
    run.add_argument("--config", type=Path, help="TOML config (default /etc/oomguard/"
                     "oomguard.toml if present, else the embedded default)")
    run.add_argument("--cgroup", action="append", default=[], metavar="PATH",
                     help="memory cgroup to guard (repeatable); replaces the config's guards")
    run.add_argument("--threshold", type=_fraction_arg, default=0.85,
                     help="act at this share of the limit (default 85%%)")
    run.add_argument("--on-failure", choices=(ON_FAILURE_THAW, ON_FAILURE_KILL),
                     default=ON_FAILURE_THAW)
    run.add_argument("--poll-interval", type=_duration_arg, help="e.g. 100ms")
    run.add_argument("--no-events", action="store_true", help="poll instead of eventfd")
    run.add_argument("--dry-run", action="store_true", help="decide and log, touch nothing")
    run.add_argument("--criu", help="path to criu (default: auto)")

    cp = sub.add_parser("checkpoint", help="checkpoint a process tree now")
    cp.add_argument("pid", type=int)
    cp.add_argument("--reason", default="on demand")
    cp.add_argument("--on-failure", choices=(ON_FAILURE_THAW, ON_FAILURE_KILL),
                    default=ON_FAILURE_THAW)
    cp.add_argument("--criu", help="path to criu (default: auto)")

    ls = sub.add_parser("list", help="list checkpoints")
    ls.add_argument("--json", action="store_true")
    show = sub.add_parser("show", help="show one checkpoint")
    show.add_argument("id")
    rs = sub.add_parser("restore", help="bring a checkpoint back")
    rs.add_argument("id")
    rs.add_argument("--cgroup", metavar="PATH", help="restore into this memory cgroup")
    rs.add_argument("--force", action="store_true",
                    help="restore even if already restored or the cgroup looks too small")
    rs.add_argument("--criu", help="path to criu (default: auto)")
    fg = sub.add_parser("forget", help="delete a checkpoint")
    fg.add_argument("id")
    ex = sub.add_parser("exec", help="run CMD as PID 1 of its own PID namespace "
                        "(always restorable)")
    ex.add_argument("--cgroup", metavar="PATH", help="enter this memory cgroup first")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")
    doc = sub.add_parser("doctor", help="check the machine")
    doc.add_argument("--criu", help="path to criu (default: auto)")
    cc = sub.add_parser("check-config", help="validate a config file")
    cc.add_argument("file", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    handler = COMMANDS[args.command]
    try:
        return int(handler(args))
    except ConfigError as exc:
        for issue in exc.issues:
            print(f"oomguard: config error: {issue}", file=sys.stderr)
        return EXIT_USAGE
    except (RestoreFailed, StoreError, CheckpointFailed, CriuError, ProcessGone) as exc:
        print(f"oomguard: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OomguardError as exc:
        print(f"oomguard: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


# -- helpers -------------------------------------------------------------------------------------

def _base_config(args: argparse.Namespace) -> DaemonConfig:
    path = getattr(args, "config", None)
    if path is not None:
        config = load_config(path)
    elif DEFAULT_CONFIG_PATH.exists():
        config = load_config(DEFAULT_CONFIG_PATH)
    else:
        config = load_embedded_config()
    if args.store is not None:
        config = replace(config, store=args.store)
    criu = getattr(args, "criu", None)
    if criu:
        config = replace(config, criu=replace(config.criu, binary=criu))
    return config


def _store(args: argparse.Namespace) -> Store:
    return Store(args.store or Path("/var/lib/oomguard"))


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise OomguardError(f"{what} needs root (checkpoints are root-only: they hold every "
                            "secret of the process)")


# -- commands ------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from oomguard.daemon import Daemon
    from oomguard.wiring import build_checkpointer, build_criu, remove_criu_cgroup

    config = _base_config(args)
    if args.cgroup:
        guard = GuardConfig(cgroups=tuple(args.cgroup), threshold=args.threshold,
                            on_failure=args.on_failure, events=not args.no_events)
        config = replace(config, guards=(guard,), source="command line")
    if args.poll_interval is not None:
        config = replace(config, poll_interval=args.poll_interval)
    if args.dry_run:
        config = replace(config, dry_run=True)
    log = get_logger()
    _need_root("oomguard run")
    layout = read_layout()
    proc = ProcReader()
    issues = []
    for index, guard in enumerate(config.guards):
        for path in guard.cgroups:
            try:
                open_cgroup(path, layout)
            except ValueError as exc:
                where = "--cgroup" if args.cgroup else f"guard[{index}].cgroups"
                issues.append(ConfigIssue(config.source, where, str(exc)))
    if issues:
        raise ConfigError(issues)
    criu = build_criu(config.criu, layout, proc)
    daemon = Daemon(config, build_checkpointer(config, criu, proc), layout, log, proc=proc)
    daemon.install_signal_handlers()
    log.info("guard.started", version=__version__, config=config.source, store=str(config.store),
             criu=criu.binary, criu_version=".".join(map(str, criu.version)),
             cgroup_mode=layout.mode, guards=len(config.guards), dry_run=config.dry_run)
    if not config.guards:
        log.warning("guard.idle", explanation="no [[guard]] rules: nothing is watched; add one "
                    "to the config or pass --cgroup")
    try:
        daemon.arm()
        daemon.run()
    finally:
        daemon.close()
        remove_criu_cgroup(layout, proc)
        log.info("guard.stopped")
    return EXIT_OK


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from oomguard.wiring import build_checkpointer, build_criu, remove_criu_cgroup

    _need_root("oomguard checkpoint")
    config = _base_config(args)
    layout = read_layout()
    proc = ProcReader()
    log = get_logger()
    tree = tree_of(args.pid, proc)
    rel = proc.memory_cgroup(args.pid)
    cgroup = open_cgroup(rel, layout) if rel and layout.memory_mount else None
    criu = build_criu(config.criu, layout, proc)
    checkpointer = build_checkpointer(config, criu, proc, on_failure=args.on_failure)
    try:
        result = checkpointer.checkpoint(tree, cgroup, args.reason)
    except CheckpointFailed as exc:
        log.error("checkpoint.failed", pid=args.pid, outcome=exc.outcome, error=str(exc))
        return EXIT_FAILED
    finally:
        remove_criu_cgroup(layout, proc)
    meta = result.meta
    log.info("checkpoint.done", id=meta.id, pid=meta.pid, image_bytes=meta.image_bytes,
             seconds=round(result.timings.total_s, 3))
    print(meta.id)
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    _need_root("oomguard list")
    metas = _store(args).list()
    if args.json:
        print(json.dumps([asdict(m) for m in metas], indent=2))
        return EXIT_OK
    rows = [("ID", "PID", "USER", "RSS", "IMAGE", "STATE", "CREATED", "COMMAND")]
    for m in metas:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created))
        rows.append((m.id, str(m.pid), m.user, format_size(m.rss_bytes),
                     format_size(m.image_bytes), m.state, created, m.command[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    _need_root("oomguard show")
    store = _store(args)
    meta = store.get(args.id)
    print(meta.to_json())
    return EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    from oomguard.wiring import build_criu, build_restorer, remove_criu_cgroup

    _need_root("oomguard restore")
    config = _base_config(args)
    layout = read_layout()
    proc = ProcReader()
    log = get_logger()
    store = Store(config.store)
    meta = store.get(args.id)
    target = None
    original = None
    if args.cgroup:
        try:
            target = open_cgroup(args.cgroup, layout)
        except ValueError as exc:
            print(f"oomguard: --cgroup: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if not target.exists():
            print(f"oomguard: --cgroup: {target.path} does not exist", file=sys.stderr)
            return EXIT_USAGE
    elif meta.cgroup and layout.memory_mount is not None:
        candidate = open_cgroup(meta.cgroup, layout)
        original = candidate if candidate.exists() else None
    criu = build_criu(config.criu, layout, proc)
    restorer = build_restorer(config, criu, proc)
    try:
        result = restorer.restore(args.id, target=target, original=original, force=args.force)
    except RestoreFailed as exc:
        log.error("restore.failed", id=args.id, error=str(exc))
        raise
    finally:
        remove_criu_cgroup(layout, proc)
    log.info("restore.done", id=args.id, pid=result.pid, seconds=round(result.seconds, 3),
             cgroup=result.meta.restored_cgroup)
    print(result.pid)
    return EXIT_OK


def cmd_forget(args: argparse.Namespace) -> int:
    _need_root("oomguard forget")
    _store(args).forget(args.id)
    get_logger().info("checkpoint.forgotten", id=args.id)
    return EXIT_OK


def cmd_exec(args: argparse.Namespace) -> int:
    from oomguard.execwrap import exec_argv

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        print("oomguard: exec: no command given (oomguard exec -- CMD ...)", file=sys.stderr)
        return EXIT_USAGE
    if args.cgroup:
        cgroup = open_cgroup(args.cgroup, read_layout())
        cgroup.add_proc(os.getpid())
    argv = exec_argv(command)
    os.execv(argv[0], argv)
    return EXIT_FAILED  # not reached


def cmd_doctor(args: argparse.Namespace) -> int:
    from oomguard.doctor import run_checks

    checks = run_checks(args.store or Path("/var/lib/oomguard"), args.criu or "auto")
    for check in checks:
        print(check.line())
    return EXIT_OK if all(c.ok or c.warn_only for c in checks) else EXIT_FAILED


def cmd_check_config(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    print(f"{args.file}: OK ({len(config.guards)} guard rule(s))")
    return EXIT_OK


COMMANDS: dict[str, Any] = {
    "run": cmd_run, "checkpoint": cmd_checkpoint, "list": cmd_list, "show": cmd_show,
    "restore": cmd_restore, "forget": cmd_forget, "exec": cmd_exec, "doctor": cmd_doctor,
    "check-config": cmd_check_config,
}
