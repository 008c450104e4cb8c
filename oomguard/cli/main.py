"""The `oomguard` command line. Exit status: 0 done, 1 the operation failed, 2 bad input."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

from oomguard.cli.parser import build_parser
from oomguard.cli.progress import dump_bytes, progress, resident_bytes
from oomguard.cli.restorewait import restore_when_it_fits
from oomguard.config.discovery import CliConfig, choose_config, discover_cli_config
from oomguard.config.loading import (
    EMBEDDED_CONFIG,
    DaemonConfig,
    load_config,
    load_embedded_config,
    parse_config,
)
from oomguard.control.backend import Backend, LocalBackend, open_backend
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
from oomguard.model.units import format_size
from oomguard.observe.logsetup import configure_logging, get_logger
from oomguard.observe.rendering import (
    budget_text,
    event_fields,
    list_text,
    output_width,
    paged_out_detail,
    paged_out_text,
    restore_command,
    restored_line,
    show_text,
    taken_line,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
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

def _cli_config(args: argparse.Namespace) -> CliConfig:
    found = discover_cli_config(args.global_config, getattr(args, "config", None))
    if found.fallback is not None:
        get_logger().debug("config.unreadable", config=found.fallback,
                           explanation="the embedded default stands in (its socket)")
    return found


def _base_config(args: argparse.Namespace) -> DaemonConfig:
    found = getattr(args, "cli_config", None)
    config = (found if found is not None else _cli_config(args)).config
    if args.store is not None:
        config = replace(config, store=args.store)
    criu = getattr(args, "criu", None)
    if criu:
        config = replace(config, criu=replace(config.criu, binary=criu))
    return config


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


# Verbs that may make the store they are given (the first checkpoint makes it).
MAKE_STORE_COMMANDS = ("checkpoint", "exec")


def _backend(args: argparse.Namespace) -> Backend:
    config = _base_config(args)
    if args.store is not None and args.socket is None \
            and args.command not in MAKE_STORE_COMMANDS and not args.store.is_dir():
        raise BadInput(f"--store {args.store}: no such directory (no checkpoint store there)")
    return open_backend(config, args.socket, store_given=args.store is not None)


def _call(args: argparse.Namespace, method: str, **parameters: Any) -> dict[str, Any]:
    backend = _backend(args)
    try:
        return backend.call(method, **parameters)
    finally:
        backend.close()


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from oomguard.lifecycle.jobroot import job_root
    from oomguard.sense.procfs import ProcReader

    log = get_logger()
    try:  # the tree CRIU dumps: a process inside an exec job stands for the job, from its init
        root = job_root(ProcReader(), args.pid)
    except ProcessGone:
        root = args.pid  # the daemon says so
    try:
        with progress(f"checkpoint of {args.pid}", lambda: dump_bytes(root), sys.stderr):
            meta = _call(args, "Checkpoint", pid=args.pid, reason=args.reason)["checkpoint"]
    except CheckpointFailed as exc:
        log.error("checkpoint.failed", pid=args.pid, outcome=exc.outcome, error=str(exc))
        return EXIT_FAILED
    except ControlError as exc:
        log.error("checkpoint.failed", pid=args.pid, error=str(exc))
        return EXIT_FAILED
    asked = meta.get("asked_pid", args.pid)
    # The tree taken: its root (`pid`), and where they differ, the PID asked for and the job's
    # main process and own command (an `oomguard exec` job's CMD, not its init).
    job = {"asked_pid": asked, "job_pid": meta.get("job_pid"),
           "job_command": meta.get("job_command")}
    job = {k: v for k, v in job.items()
           if v is not None and v != meta.get("command" if k == "job_command" else "pid")}
    log.info("checkpoint.done", id=meta["id"], pid=meta["pid"], image_bytes=meta["image_bytes"],
             seconds=meta.get("seconds"), freeze_s=meta.get("freeze_s"),
             dump_s=meta.get("dump_s"), commit_s=meta.get("commit_s"),
             tasks=len(meta.get("pids") or []), command=meta.get("command"), **job,
             restore=restore_command(meta["id"]))
    if sys.stderr.isatty():  # people read which tree it took; scripts read the id on stdout
        print(taken_line(meta, asked, output_width()), file=sys.stderr)
    print(meta["id"])
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    backend = _backend(args)
    try:
        listing = backend.call("List")
    finally:
        backend.close()
    if isinstance(backend, LocalBackend) and args.store is None:  # said: scripts read stdout
        config = _base_config(args)
        print(f"oomguard: no daemon answers on {args.socket or config.socket}: listing the "
              f"store {config.store} directly", file=sys.stderr)
    metas = listing["checkpoints"]
    for bad in listing.get("skipped") or []:
        print(f"oomguard: warning: store entry {bad['entry']} skipped: {bad['reason']}",
              file=sys.stderr)
    paged = listing.get("paged_out") or []
    if args.json:
        print(json.dumps(metas + paged, indent=2))
        return EXIT_OK
    print(list_text(metas, output_width()))
    if paged:
        print(paged_out_text(paged))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    meta = _call(args, "Show", id=args.id)["checkpoint"]
    text = paged_out_detail if meta.get("state") == "paged-out" else show_text
    print(json.dumps(meta, indent=2, sort_keys=True) if args.json
          else text(meta, output_width()))
    return EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        print("oomguard: restore: --timeout goes with --wait", file=sys.stderr)
        return EXIT_USAGE
    shown: dict[str, Any] = {}
    if sys.stderr.isatty():
        with contextlib.suppress(OomguardError):
            shown = _call(args, "Show", id=args.id)["checkpoint"]
    pids = [] if shown.get("pidns") else list(shown.get("pids", []))
    label = f"restore of {shown.get('id', args.id)}"

    def attempt() -> dict[str, Any]:
        with progress(label, lambda: resident_bytes(pids), sys.stderr,
                      total=shown.get("rss_bytes"), delay=0.5 if args.wait else 0.0):
            return _call(args, "Restore", id=args.id, cgroup=args.cgroup,
                         force=args.force or None, lazy=args.lazy or None)

    try:
        result = restore_when_it_fits(attempt, wait=args.wait, timeout=args.timeout,
                                      tell=lambda text: print(f"oomguard: {text}",
                                                              file=sys.stderr, flush=True))
    except (RestoreFailed, ControlError) as exc:
        get_logger().error("restore.failed", id=args.id, error=str(exc))
        raise
    log = get_logger()  # structlog loads now: the job runs already
    log.info("restore.done", id=result["id"], pid=result["pid"], seconds=result["seconds"],
             verify_s=result.get("verify_s"), total_s=result.get("total_s"),
             lazy=result.get("lazy"), warmed_bytes=result.get("warmed_bytes") or None,
             cgroup=result.get("cgroup"),
             gpu_pids=result.get("gpu_pids") or None)
    if result.get("lazy_fallback"):
        print(f"oomguard: restored eagerly, not lazily: {result['lazy_fallback']}",
              file=sys.stderr, flush=True)
    if result.get("gpu_error"):
        log.error("restore.gpu_failed", id=result["id"], pid=result["pid"],
                  error=result["gpu_error"])
    # People (a terminal) read the sentence; scripts read the PID on stdout, as before.
    if sys.stdout.isatty():
        print(restored_line(result), flush=True)
    else:
        print(result["pid"], flush=True)
        print(restored_line(result), file=sys.stderr, flush=True)
    if not args.detach and os.isatty(0) and os.isatty(1):
        from oomguard.terminal.commands import attach_to, holder_of_checkpoint

        with contextlib.suppress(OomguardError):
            path = holder_of_checkpoint(_call(args, "Show", id=result["id"])["checkpoint"])
            if path:
                return attach_to(path)
    return EXIT_OK


def cmd_attach(args: argparse.Namespace) -> int:
    from oomguard.lifecycle.jobroot import job_process
    from oomguard.terminal.commands import attach

    return attach(args.target, lambda method, **p: _call(args, method, **p), job_process)


def cmd_forget(args: argparse.Namespace) -> int:
    forgotten = _call(args, "Forget", id=args.id)
    get_logger().info("checkpoint.forgotten", id=forgotten.get("id", args.id))
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    done = _call(args, "Resume", id=args.id)["resumed"]
    get_logger().info("pageout.resumed", id=done["id"], pid=done["pid"],
                      continued=done["continued"], gone=done["gone"],
                      swap_removed=done["swap_removed"], swap_kept=done["swap_kept"] or None)
    print(done["pid"])
    return EXIT_OK


def cmd_gpu_resume(args: argparse.Namespace) -> int:
    _call(args, "GpuResume", pid=args.pid)
    get_logger().info("gpu.vram_restored", pid=args.pid)
    return EXIT_OK


def cmd_resume_job(args: argparse.Namespace) -> int:
    from oomguard.lifecycle.jobresume import resume_job
    from oomguard.sense.procfs import ProcReader

    job = args.job if args.job is not None else int(os.environ.get("SLURM_JOB_ID") or 0)
    if not job:
        print("oomguard: resume-job: no --job and no $SLURM_JOB_ID", file=sys.stderr)
        return EXIT_USAGE
    pid = resume_job(lambda method, **p: _call(args, method, **p), job, ProcReader(),
                     get_logger(), wait=not args.no_wait)
    print(pid)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    status = _call(args, "Status")["status"]
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"daemon: {'running' if status.get('daemon') else 'not running (direct access)'}")
    for guard in status.get("guards", []):
        usage = guard.get("usage")
        limit = guard.get("limit")
        fill = f"{format_size(usage)} / {format_size(limit)}" if usage is not None and limit \
            else "no limit" if usage is not None else "absent"
        print(f"guard {guard['cgroup']}: {fill}, act at {guard['threshold']:.0%}; "
              f"{guard['detection']}")
    cps = status.get("checkpoints", {})
    print(f"checkpoints: {cps.get('count', 0)} ({cps.get('checkpointed', 0)} not restored), "
          f"{format_size(cps.get('bytes', 0))}")
    paged = status.get("paged_out") or {}
    if paged.get("count"):
        print(f"paged out: {paged['count']} tree(s) stopped until they fit, "
              f"{format_size(paged.get('bytes', 0))} in swap ({', '.join(paged.get('ids', []))}; "
              "`oomguard resume ID`)")
    store = status.get("store")
    if store:
        print(f"store: {budget_text(store)}")
    width = output_width()
    for event in status.get("recent_events", [])[-10:]:
        head = f"  {event.get('time', '')}  {event.get('event')}  "
        print(head + event_fields(event, width=width - len(head)))
    return EXIT_OK


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
