"""The commands on checkpoints and paged-out trees, each a request to the daemon (or, where
none answers, to the store itself): checkpoint, list, show, restore, attach, forget, resume,
gpu-resume, resume-job, status."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from oomguard.cli.commandbase import EXIT_FAILED, EXIT_OK, EXIT_USAGE, _backend, _base_config, _call
from oomguard.cli.progress import dump_bytes, progress, resident_bytes
from oomguard.cli.restorewait import restore_when_it_fits
from oomguard.control.backend import LocalBackend
from oomguard.control.client import ControlError
from oomguard.model.errors import CheckpointFailed, OomguardError, ProcessGone, RestoreFailed
from oomguard.model.units import format_size
from oomguard.observe.logsetup import get_logger
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
