"""CRIU as an actuator: locating a binary that works here, building argv, running dump/restore.

CRIU never fsyncs its images and kills the tree right after a successful dump. Its post-dump
action script is the commit point: oomguard's hook (oomguard/store/criu_hook.py) makes the images
durable and drops their page cache there; if it fails, CRIU resumes the tree instead of killing it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.model.atomicfile import write_atomically
from oomguard.model.errors import CriuError
from oomguard.model.runner import CommandRunner, SubprocessRunner, executable_candidates
from oomguard.store import criu_hook
from oomguard.store.criu_hook import VERIFY_GATE_ENV

CRIU_CANDIDATES = ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/bin/criu")
# CRIU <= 4.1 cannot dump TCP/UDP sockets on kernels >= 6.16, and 3.x fails on 6.18's vDSO.
MIN_CRIU_VERSION = (4, 2)
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
HOOK_MODULE = Path(criu_hook.__file__)  # run as a script, outside the package's import path
# The hook's post-resume leaves these tasks stopped (pids in the tree's own PID namespace,
# comma-separated): CRIU passes its environment on to its action scripts.
KEEP_STOPPED_ENV = "OOMGUARD_KEEP_STOPPED"
# The hook's post-resume continues nothing: the restore runs under the job's session leader
# (oomguard/terminal/leader.py), which takes the terminal's foreground once CRIU is done and
# then continues the tree (a job continued earlier could read the terminal first).
CONTINUE_LATER_ENV = "OOMGUARD_CONTINUE_LATER"
RESTORE_PIDFILE = "restore.pid"


def parse_version(text: str) -> tuple[int, ...] | None:
    """`criu --version` output ('Version: 4.2.1') -> (4, 2, 1)."""
    match = re.search(r"^Version:\s*(\d+(?:\.\d+)*)", text, re.MULTILINE)
    return tuple(int(x) for x in match.group(1).split(".")) if match else None


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in version)


def log_tail(path: Path, lines: int = 12) -> str:
    """The error lines of a CRIU log (or its last lines): what the event shows as the reason."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "Error" in line and "RLIMIT_NOFILE" not in line]
    return "\n".join((errors or text)[-lines:])


@dataclass(frozen=True)
class CriuOptions:
    ghost_limit: int = 64 * 1024 * 1024  # deleted-but-open files (DataLoader batches in /dev/shm)
    timeout: float = 300.0  # whole dump or restore
    seize_timeout: int = 10  # CRIU's --timeout for collecting tasks
    shell_job: bool = True  # victims are rarely session leaders
    tcp_close: bool = True  # restore-later: peers time out anyway; no firewall rules left behind
    # A server under connection load has connections in its listening socket's accept queue,
    # which CRIU refuses ("In-flight connection (l)") unless told to drop them: a half-open
    # connection is the client's to retry. Dump only (restore has nothing to skip).
    skip_in_flight: bool = True
    ext_unix_sk: bool = True
    file_locks: bool = True
    log_level: int = 4
    libdir: str | None = None  # CRIU's plugin directory (an empty one turns its plugins off)
    extra_dump_args: tuple[str, ...] = ()
    extra_restore_args: tuple[str, ...] = ()


def _common_args(opts: CriuOptions) -> list[str]:
    args = [f"-v{opts.log_level}"]
    if opts.shell_job:
        args.append("--shell-job")
    if opts.tcp_close:
        args.append("--tcp-close")
    if opts.ext_unix_sk:
        args.append("--ext-unix-sk")
    if opts.file_locks:
        args.append("--file-locks")
    if opts.libdir is not None:
        args += ["--libdir", opts.libdir]
    return args


def dump_argv(criu: str, pid: int, images_dir: Path, opts: CriuOptions,
              action_script: Path | None) -> list[str]:
    argv = [criu, "dump", "--tree", str(pid), "--images-dir", str(images_dir),
            "--log-file", DUMP_LOG, "--ghost-limit", str(opts.ghost_limit),
            "--timeout", str(opts.seize_timeout), *_common_args(opts)]
    if opts.skip_in_flight:
        argv.append("--skip-in-flight")
    if action_script is not None:
        argv += ["--action-script", str(action_script)]
    return argv + list(opts.extra_dump_args)


def restore_argv(criu: str, images_dir: Path, opts: CriuOptions, pidfile: Path,
                 cgroup_root: str | None, work_dir: Path,
                 action_script: Path | None = None, lazy: bool = False) -> list[str]:
    """Restore detached (the tree survives CRIU and the CLI), optionally into another memory
    cgroup: `--cgroup-root memory:/path` (v1) or `--cgroup-root /path` (v2). `lazy`: the
    memory comes from a `criu lazy-pages` daemon listening in `work_dir`."""
    argv = [criu, "restore", "--images-dir", str(images_dir), "--work-dir", str(work_dir),
            "--log-file", RESTORE_LOG, "--restore-detached", "--pidfile", str(pidfile),
            *_common_args(opts)]
    if lazy:
        argv.append("--lazy-pages")
    if action_script is not None:
        argv += ["--action-script", str(action_script)]
    if cgroup_root is not None:
        argv += ["--cgroup-root", cgroup_root]
    return argv + list(opts.extra_restore_args)


# post-resume with no task to leave stopped: the shell continues the restored tree itself,
# parents first, as criu_hook.continue_tree does (tree_pids' walk of the children files). The
# job runs from its SIGCONT: a Python start (10-20 ms here) later otherwise.
CONTINUE_TREE_SH = (
    'q=$CRTOOLS_INIT_PID; case $q in ""|*[!0-9]*) exit 0 ;; esac\n'
    'while :; do set -- $q; [ $# -gt 0 ] || break; p=$1; shift; q=$*\n'
    '  kill -CONT "$p" 2>/dev/null\n'
    '  for c in /proc/"$p"/task/*/children; do k=; { read -r k < "$c"; } 2>/dev/null;'
    ' q="$q $k"; done\n'
    'done\nexit 0\n')


def hook_script_text(python: str) -> str:
    # Only post-dump, post-resume and (with a verification gate) post-restore have work to do:
    # no Python for the other actions, nor for a post-resume with no task kept stopped.
    return ('#!/bin/sh\ncase "$CRTOOLS_SCRIPT_ACTION" in post-dump) ;;'
            f' post-resume) [ -z "${CONTINUE_LATER_ENV}" ] || exit 0;'
            f' [ -n "${KEEP_STOPPED_ENV}" ] || {{\n{CONTINUE_TREE_SH}}} ;;'
            f' post-restore) [ -n "${VERIFY_GATE_ENV}" ] || exit 0 ;; *) exit 0 ;;'
            f' esac\nexec "{python}" -I -S "{HOOK_MODULE}"\n')


@dataclass
class Criu:
    """A CRIU binary and how to run it. `cgroup_procs` confines CRIU (and so the page cache of
    the images it writes) to a memory cgroup of its own instead of the guarded one."""

    binary: str
    version: tuple[int, ...]
    runner: CommandRunner = field(default_factory=SubprocessRunner)
    options: CriuOptions = field(default_factory=CriuOptions)
    cgroup_procs: Path | None = None
    # Runs CRIU in the host's mount namespace when the daemon has one of its own
    # (oomguard/act/hostns.py): ("nsenter", "--mount=/proc/1/ns/mnt", "--") or ().
    host_ns: tuple[str, ...] = ()

    def confined(self, argv: list[str]) -> list[str]:
        """`argv` run inside CRIU's memory cgroup (where there is one), in the host's mount
        namespace (where the daemon has another)."""
        argv = [*self.host_ns, *argv]
        if self.cgroup_procs is None:
            return argv
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup_procs), *argv]

    def install_hook(self, directory: Path) -> Path:
        """Write the post-dump hook (an executable: CRIU execs it directly, no shell)."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / "criu-post-dump"
        text = hook_script_text(sys.executable)
        if not path.exists() or path.read_text() != text:
            # Not fsync'd: written on the dump's path, and rewritten whenever its text differs
            # (one a crash left empty included).
            write_atomically(path, text, 0o700, sync=False)
        return path

    def dump(self, pid: int, images_dir: Path, hook: Path | None, lock_fd: int | None = None,
             extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        """`lock_fd` (an flock'd fd on the checkpoint's lock file) is inherited by CRIU, so the
        lock says "a dump is writing here" for as long as CRIU lives, even if we die.
        `extra_args`: this dump's own (e.g. `--external tty[...]`); `env`: for the action
        script (its digest gate)."""
        argv = [*dump_argv(self.binary, pid, images_dir, self.options, hook), *extra_args]
        result = self.runner.run(self.confined(argv), timeout=self.options.timeout, env=env,
                                 pass_fds=() if lock_fd is None else (lock_fd,))
        if result.timed_out:
            raise CriuError(f"criu dump timed out after {self.options.timeout:.0f}s",
                            log_tail(images_dir / DUMP_LOG))
        if result.returncode != 0:
            raise CriuError(f"criu dump exited with status {result.returncode}",
                            log_tail(images_dir / DUMP_LOG) or result.stderr.strip()[-2000:])

    def restore(self, images_dir: Path, work_dir: Path, cgroup_root: str | None,
                hook: Path | None = None, extra_args: Sequence[str] = (),
                pass_fds: Sequence[int] = (), keep_stopped: Sequence[int] = (),
                env: Mapping[str, str] | None = None, lazy: bool = False,
                wrapper: Sequence[str] = ()) -> int:
        """Restore detached; returns the restored root's PID (host namespace). `hook` (the
        action script) continues the tree at post-resume, while CRIU still lives: a tree
        dumped stopped comes back stopped, and when CRIU, its parent, exits, a stopped process
        group it leaves orphaned in its session gets SIGHUP from the kernel, and dies.
        `keep_stopped`: namespace pids of tasks the user had stopped; the hook leaves them so.
        `env`: more for the action script (the verification gate). `lazy`: --lazy-pages.
        `wrapper`: CRIU runs under it (the session leader of a job typed at a shell prompt:
        it continues nothing at post-resume; the caller continues the tree)."""
        pidfile = work_dir / RESTORE_PIDFILE
        # CRIU opens these with O_CREAT (following a symlink): whatever is there goes first.
        pidfile.unlink(missing_ok=True)
        (work_dir / RESTORE_LOG).unlink(missing_ok=True)
        argv = [*restore_argv(self.binary, images_dir, self.options, pidfile, cgroup_root,
                              work_dir, hook, lazy), *extra_args]
        script_env = dict(env or {})
        if keep_stopped:
            script_env[KEEP_STOPPED_ENV] = ",".join(map(str, keep_stopped))
        if wrapper:
            script_env[CONTINUE_LATER_ENV] = "1"
        result = self.runner.run([*wrapper, *self.confined(argv)], timeout=self.options.timeout,
                                 env=script_env or None, pass_fds=pass_fds)
        if result.timed_out or result.returncode != 0:
            what = "timed out" if result.timed_out else f"exited with status {result.returncode}"
            raise CriuError(f"criu restore {what}",
                            log_tail(work_dir / RESTORE_LOG) or result.stderr.strip()[-2000:])
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise CriuError("criu restore succeeded but wrote no pidfile") from exc

    def check(self) -> tuple[bool, str]:
        result = self.runner.run([*self.host_ns, self.binary, "check"], timeout=60)
        text = (result.stdout + result.stderr).strip()
        ok = result.returncode == 0 and "Looks good" in text
        return ok, text.splitlines()[-1] if text else f"exit status {result.returncode}"


def probe_version(binary: str, runner: CommandRunner) -> tuple[int, ...] | None:
    try:
        result = runner.run([binary, "--version"], timeout=10)
    except OSError:
        return None
    return parse_version(result.stdout) if result.returncode == 0 else None


def find_criu(configured: str | None = None, runner: CommandRunner | None = None,
              minimum: tuple[int, ...] = MIN_CRIU_VERSION) -> tuple[str, tuple[int, ...]]:
    """The first CRIU that is new enough: the configured path, $OOMGUARD_CRIU, then the places
    scripts/setup and Debian install it, then $PATH. Raises CriuError saying what was found."""
    runner = runner or SubprocessRunner()
    seen = []
    for candidate in executable_candidates(configured, "OOMGUARD_CRIU", CRIU_CANDIDATES, "criu"):
        if not os.access(candidate, os.X_OK):
            continue
        version = probe_version(candidate, runner)
        if version is None:
            seen.append(f"{candidate} (no version)")
            continue
        if version >= minimum:
            return candidate, version
        seen.append(f"{candidate} ({format_version(version)})")
    found = ", ".join(seen) if seen else "none"
    raise CriuError(f"no CRIU >= {format_version(minimum)} found (found: {found}); "
                    "run scripts/setup to build one")

