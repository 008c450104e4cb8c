"""On a systemd host, a restored job lands in a unit systemd knows about.

A job checkpointed out of a systemd unit (a `systemd-run --scope` job, a session's scope, a
service's process) leaves that unit: an emptied scope is gone at once, a service whose main
process went is failed. CRIU would put the restored tasks back into the unit's cgroup path,
made anew behind systemd's back (a stray cgroup) or inside a dead unit. Instead, where the
checkpoint's cgroup is a unit's (`*.scope`, `*.service`) and no process is left in it, the
restore goes into a new transient scope, `oomguard-restore-ID.scope`, in the same slice and
under the same manager (the system's, or the user's own `user@UID.service`, through
`systemd-run --user` run as that user). A scope needs a process to exist: `systemd-run
--scope` runs a placeholder (`sleep`) in it; the restored tasks join it (CRIU --cgroup-root);
the placeholder is then ended.

No systemd (no /run/systemd/system), cgroup v1, or a cgroup that still holds processes (a unit
still running): nothing changes, the restore goes where it went before."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from oomguard.cgroup.base import MemoryCgroup
from oomguard.model.errors import RestoreFailed

SYSTEMD_RUN_DIR = Path("/run/systemd/system")  # sd_booted(3)
SCOPE_PREFIX = "oomguard-restore-"
PLACEHOLDER = ("sleep", "infinity")
START_TIMEOUT = 15.0  # systemd-run until its placeholder is in the new scope
_USER_MANAGER = re.compile(r"^user@(\d+)\.service$")
_UNIT = (".scope", ".service")


@dataclass(frozen=True)
class ScopePlan:
    """Where a checkpoint's restore goes: `unit` in `slice` of the system's manager, or of
    user `uid`'s own (user@UID.service)."""

    unit: str
    slice: str
    uid: int | None  # None: the system's manager
    description: str


def plan_scope(cgroup: str, checkpoint_id: str) -> ScopePlan | None:
    """The scope for a checkpoint taken out of `cgroup` (its path in the unified hierarchy),
    or None when that is no systemd unit's cgroup."""
    parts = [part for part in cgroup.split("/") if part]
    if not parts or not parts[-1].endswith(_UNIT):
        return None
    uid = None
    slices = parts[:-1]
    for index, part in enumerate(parts[:-1]):
        found = _USER_MANAGER.match(part)
        if found:
            uid, slices = int(found.group(1)), parts[index + 1:-1]
    named = [part for part in slices if part.endswith(".slice")]
    slice_name = named[-1] if named else ("app.slice" if uid is not None else "system.slice")
    unit = SCOPE_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", checkpoint_id) + ".scope"
    return ScopePlan(unit=unit, slice=slice_name, uid=uid,
                     description=f"oomguard: restored checkpoint {checkpoint_id} "
                     f"(was {parts[-1]})")


def scope_argv(plan: ScopePlan) -> list[str]:
    """The placeholder's command: `systemd-run --scope` (as the user, for their manager)."""
    run = ["systemd-run", "--scope", "--quiet", "--collect", f"--unit={plan.unit}",
           f"--slice={plan.slice}", f"--description={plan.description}"]
    if plan.uid is None:
        return [*run, "--", *PLACEHOLDER]
    user = pwd.getpwuid(plan.uid)
    return ["setpriv", f"--reuid={plan.uid}", f"--regid={user.pw_gid}", "--init-groups", "--",
            "env", "-i", f"XDG_RUNTIME_DIR=/run/user/{plan.uid}",
            f"DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/{plan.uid}/bus",
            f"HOME={user.pw_dir}", f"USER={user.pw_name}", "PATH=/usr/bin:/bin",
            run[0], "--user", *run[1:], "--", *PLACEHOLDER]


class SystemdScopes:
    """`holding(cgroup, id)`: a context giving the cgroup of a new scope to restore into
    (`opener` makes it from its path in the unified hierarchy), or None where the restore
    goes where it always went; the placeholder is ended on the way out (the scope stays as
    long as the restored job)."""

    def __init__(self, opener: Callable[[str], MemoryCgroup], run_dir: Path = SYSTEMD_RUN_DIR,
                 cgroup_root: Path = Path("/sys/fs/cgroup"), proc_root: Path = Path("/proc"),
                 popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
                 clock: Callable[[], float] = time.monotonic,
                 timeout: float = START_TIMEOUT) -> None:
        self.opener = opener
        self.run_dir = run_dir
        self.cgroup_root = cgroup_root
        self.proc_root = proc_root
        self.popen = popen
        self.clock = clock
        self.timeout = timeout

    def available(self) -> bool:
        return self.run_dir.is_dir() and (self.cgroup_root / "cgroup.controllers").exists()

    def wanted(self, cgroup: str) -> bool:
        """The checkpoint's cgroup is a unit's and holds no process now (gone, or a unit
        whose process this was)."""
        if not self.available() or not cgroup.rstrip("/").endswith(_UNIT):
            return False
        try:
            return not (self.cgroup_root / cgroup.lstrip("/") / "cgroup.procs").read_text().strip()
        except OSError:
            return True  # gone: systemd removed it with its unit

    @contextlib.contextmanager
    def holding(self, cgroup: str, checkpoint_id: str) -> Iterator[MemoryCgroup | None]:
        plan = plan_scope(cgroup, checkpoint_id)
        if plan is None or not self.wanted(cgroup):
            yield None
            return
        placeholder = self.popen(scope_argv(plan), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 start_new_session=True)
        try:
            yield self.opener(self._joined(placeholder, plan))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(placeholder.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                placeholder.wait(timeout=5)
            if placeholder.stderr is not None:
                placeholder.stderr.close()

    def _joined(self, placeholder: subprocess.Popen[bytes], plan: ScopePlan) -> str:
        """The new scope's cgroup path once the placeholder is in it."""
        deadline = self.clock() + self.timeout
        while self.clock() < deadline:
            path = self._cgroup_of(placeholder.pid)
            if path is not None and path.endswith("/" + plan.unit):
                return path
            if placeholder.poll() is not None:
                error = placeholder.stderr.read().decode(errors="replace").strip() \
                    if placeholder.stderr is not None else ""
                raise RestoreFailed(f"systemd-run could not make {plan.unit} in {plan.slice} "
                                    f"(exit {placeholder.returncode}): {error[-300:]}")
            time.sleep(0.02)
        raise RestoreFailed(f"systemd-run did not make {plan.unit} within {self.timeout:g}s")

    def _cgroup_of(self, pid: int) -> str | None:
        try:
            text = (self.proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("0::"):
                return line[3:]
        return None
