"""The `oomguard` command line's arguments: every subcommand and option (oomguard.cli.main runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from oomguard import __version__
from oomguard.config.schema import ON_FAILURE_KILL, ON_FAILURE_THAW
from oomguard.model.units import bounded_duration, parse_fraction


def _fraction_arg(text: str) -> float:
    try:
        return parse_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_arg(text: str) -> float:
    try:
        return bounded_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oomguard", description="Checkpoint (CRIU) the top memory consumer of a cgroup "
        "near its limit instead of letting the OOM killer run.")
    parser.add_argument("--version", action="version", version=f"oomguard {__version__}")
    parser.add_argument("--config", dest="global_config", type=Path, metavar="FILE",
                        help="the config the service uses (default $OOMGUARD_CONFIG, else "
                        "/etc/oomguard/oomguard.toml if present, else the embedded default): "
                        "its socket and store are where every subcommand looks")
    parser.add_argument("--store", type=Path, help="checkpoint store (default: the config's, "
                        "/var/lib/oomguard); given, the CLI acts on it directly (root) instead "
                        "of asking the daemon")
    parser.add_argument("--socket", type=Path, help="the daemon's control socket (default: the "
                        "config's, /run/oomguard/control.sock)")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default="info")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(sub)
    _add_checkpoint_verbs(sub)
    _add_machine_verbs(sub)
    return parser


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="guard cgroups (the daemon)")
    run.add_argument("--config", type=Path, metavar="FILE", help="TOML config (the same as "
                     "the global --config)")
    run.add_argument("--cgroup", action="append", default=[], metavar="PATH",
                     help="memory cgroup to guard (repeatable); replaces the config's guards")
    run.add_argument("--threshold", type=_fraction_arg, default=0.85,
                     help="act at this share of the limit (default 85%%)")
    run.add_argument("--on-failure", choices=(ON_FAILURE_THAW, ON_FAILURE_KILL),
                     default=ON_FAILURE_THAW)
    run.add_argument("--poll-interval", type=_duration_arg, help="e.g. 100ms")
    run.add_argument("--no-events", action="store_true", help="poll instead of eventfd")
    run.add_argument("--dry-run", action="store_true", help="decide and log, touch nothing")
    run.add_argument("--auto-restore", action="store_true",
                     help="restore checkpoints of the --cgroup once they fit again")
    run.add_argument("--actions", help="action chain, comma-separated: e.g. "
                     "'freeze,checkpoint,kill' or 'signal:SIGUSR1:30s,checkpoint'")
    run.add_argument("--prefer", action="append", default=[], metavar="REGEX",
                     help="choose matching processes first (repeatable)")
    run.add_argument("--avoid", action="append", default=[], metavar="REGEX",
                     help="choose matching processes last (repeatable)")
    run.add_argument("--protect", action="append", default=[], metavar="REGEX",
                     help="never choose matching processes (repeatable)")
    run.add_argument("--time-to-limit", action="store_true",
                     help="act early when growth would reach the limit before a dump ends")
    run.add_argument("--criu", help="path to criu (default: auto)")


def _add_checkpoint_verbs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The verbs on checkpoints, paged-out trees and jobs."""
    cp = sub.add_parser("checkpoint", help="checkpoint a process tree now")
    cp.add_argument("pid", type=int)
    cp.add_argument("--reason", default="on demand")
    cp.add_argument("--criu", help="path to criu (default: auto)")

    st = sub.add_parser("status", help="guards, usage, checkpoints, last events")
    st.add_argument("--json", action="store_true")
    ls = sub.add_parser("list", help="list checkpoints")
    ls.add_argument("--json", action="store_true")
    show = sub.add_parser("show", help="show one checkpoint (ID: a whole id, a unique prefix "
                          "of it, or 'last', as for restore, forget and attach)")
    show.add_argument("id")
    show.add_argument("--json", action="store_true", help="its meta.json, as JSON")
    rs = sub.add_parser("restore", help="bring a checkpoint back")
    rs.add_argument("id")
    rs.add_argument("--cgroup", metavar="PATH", help="restore into this memory cgroup")
    rs.add_argument("--force", action="store_true",
                    help="restore even if already restored or the cgroup looks too small")
    rs.add_argument("--wait", action="store_true", help="if it does not fit under the "
                    "cgroup's guard (or limit) now, wait until it does (Ctrl-C gives up)")
    rs.add_argument("--timeout", type=_duration_arg, metavar="DURATION",
                    help="with --wait: give up after this long (e.g. 10m)")
    rs.add_argument("--lazy", action="store_true", help="run the job at once and let its "
                    "memory follow (userfaultfd; pages are verified as they stream in: "
                    "eager restores verify them before the job runs)")
    rs.add_argument("--criu", help="path to criu (default: auto)")
    rs.add_argument("--detach", action="store_true",
                    help="do not attach to a terminal job after restoring it")
    at = sub.add_parser("attach", help="show a terminal job's output and pass it input "
                        "(Ctrl-\\ detaches)")
    at.add_argument("target", metavar="ID|PID")
    rm = sub.add_parser("resume", help="continue a paged-out tree (after a 'pageout' action), "
                        "by its id (po-...) or a PID of it")
    rm.add_argument("id", metavar="ID|PID")
    gr = sub.add_parser("gpu-resume", help="put a process's CUDA state back on the GPU "
                        "(after a 'vram' action)")
    gr.add_argument("pid", type=int)

    rj = sub.add_parser("resume-job", help="in a requeued Slurm job's batch script: restore "
                        "its checkpoint into this allocation and wait for it to end")
    rj.add_argument("--job", type=int, help="Slurm job id (default: $SLURM_JOB_ID)")
    rj.add_argument("--no-wait", action="store_true", help="return once it is restored")

    fg = sub.add_parser("forget", help="delete a checkpoint")
    fg.add_argument("id")


def _add_machine_verbs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The verbs that run a job, check the machine, set it up and check a config."""
    ex = sub.add_parser("exec", help="run CMD as PID 1 of its own PID namespace "
                        "(always restorable)")
    ex.add_argument("--cgroup", metavar="PATH", help="enter this memory cgroup first")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")
    doc = sub.add_parser("doctor", help="check the machine")
    doc.add_argument("--criu", help="path to criu (default: auto)")
    na = sub.add_parser("notify-agent", help="show desktop notifications for this user's "
                        "checkpoints and restores (run in the user's session)")
    na.add_argument("--system-bus", default="SYSTEM", help="where the daemon's signals come from")
    na.add_argument("--session-bus", default="SESSION", help="where notifications are shown")
    iu = sub.add_parser("install-units", help="install the systemd units (the service and "
                        "the notification agent's user unit) and the default config if there "
                        "is none; says what to do next")
    iu.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"))
    iu.add_argument("--config-dir", type=Path, default=Path("/etc/oomguard"))
    iu.add_argument("--user-unit-dir", type=Path, default=Path("/etc/systemd/user"))
    cc = sub.add_parser("check-config", help="validate a config file")
    cc.add_argument("file", type=Path, nargs="?",
                    help="default: the config the CLI reads (see the global --config)")
