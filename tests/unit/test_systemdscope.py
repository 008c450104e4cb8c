"""oomguard.act.systemdscope: which scope a unit's restored job goes to, and the placeholder
that makes it (a real process here; systemd-run itself is the host lane's:
tests/integration/test_host_user.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.act.systemdscope import SystemdScopes, plan_scope, scope_argv
from oomguard.model.errors import RestoreFailed


@pytest.mark.parametrize(("cgroup", "slice_name", "uid", "was"), [
    ("/system.slice/lane-job.service", "system.slice", None, "lane-job.service"),
    ("/lane.slice/grow1.service", "lane.slice", None, "grow1.service"),
    ("/user.slice/user-1000.slice/session-3.scope", "user-1000.slice", None, "session-3.scope"),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/run-r1f.scope", "app.slice", 1000,
     "run-r1f.scope"),
    ("/user.slice/user-1001.slice/user@1001.service/app.slice/app-term.slice/vte-1.scope",
     "app-term.slice", 1001, "vte-1.scope"),
    ("/user.slice/user-1001.slice/user@1001.service/job.service", "app.slice", 1001,
     "job.service"),
])
def test_a_units_job_goes_to_a_scope_in_the_same_slice_and_manager(
        cgroup: str, slice_name: str, uid: int | None, was: str) -> None:
    plan = plan_scope(cgroup, "20261203-211949-20386-978d")
    assert plan is not None
    assert plan.unit == "oomguard-restore-20261203-211949-20386-978d.scope"
    assert (plan.slice, plan.uid) == (slice_name, uid)
    assert plan.description.endswith(f"(was {was})")


@pytest.mark.parametrize("cgroup", ["/jobs/a", "/", "", "/system.slice", "/kubepods/pod1/c"])
def test_no_scope_for_what_is_no_units_cgroup(cgroup: str) -> None:
    assert plan_scope(cgroup, "x") is None


def test_the_users_scope_is_asked_of_their_own_manager_as_them() -> None:
    plan = plan_scope("/user.slice/user-0.slice/user@0.service/app.slice/a.scope", "id")
    assert plan is not None
    argv = scope_argv(plan)
    assert argv[:4] == ["setpriv", "--reuid=0", "--regid=0", "--init-groups"]
    assert "XDG_RUNTIME_DIR=/run/user/0" in argv
    run = argv.index("systemd-run")
    assert argv[run:run + 3] == ["systemd-run", "--user", "--scope"]
    assert "--unit=oomguard-restore-id.scope" in argv and "--slice=app.slice" in argv
    assert argv[-2:] == ["sleep", "infinity"]
    system = scope_argv(plan_scope("/system.slice/a.service", "id"))  # type: ignore[arg-type]
    assert system[0] == "systemd-run" and "--user" not in system


def fake_systemd(tmp_path: Path, joins: bool) -> tuple[SystemdScopes, list[list[str]]]:
    """A host with systemd (/run/systemd/system), a unified tree, and a placeholder that is
    a real process whose /proc/PID/cgroup says it is in the new scope (or never does)."""
    run_dir, root, proc = tmp_path / "run", tmp_path / "cgroup", tmp_path / "proc"
    run_dir.mkdir()
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    started: list[list[str]] = []

    def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(argv)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]
                                 if joins else [sys.executable, "-c", "import sys; "
                                 "sys.stderr.write('Failed to start transient scope unit'); "
                                 "sys.exit(1)"], **kwargs)
        (proc / str(child.pid)).mkdir(parents=True)
        unit = next(a for a in argv if a.startswith("--unit=")).split("=", 1)[1]
        where = f"/system.slice/{unit}" if joins else "/system.slice/oomguard.service"
        (proc / str(child.pid) / "cgroup").write_text(f"0::{where}\n")
        return child

    scopes = SystemdScopes(lambda path: path, run_dir=run_dir,  # type: ignore[arg-type,return-value]
                           cgroup_root=root, proc_root=proc, popen=popen, timeout=5)
    return scopes, started


def test_a_gone_units_job_is_restored_into_a_new_scope_and_the_placeholder_ends(
        tmp_path: Path) -> None:
    scopes, started = fake_systemd(tmp_path, joins=True)
    with scopes.holding("/system.slice/lane-job.service", "cp1") as scope:
        assert scope == "/system.slice/oomguard-restore-cp1.scope"
        assert len(started) == 1
    placeholder = int(next(p.name for p in (tmp_path / "proc").iterdir()))
    assert not Path(f"/proc/{placeholder}").exists() or \
        Path(f"/proc/{placeholder}/stat").read_text().split()[2] == "Z"


def test_a_unit_still_running_or_no_unit_keeps_the_old_way(tmp_path: Path) -> None:
    scopes, started = fake_systemd(tmp_path, joins=True)
    alive = tmp_path / "cgroup" / "system.slice" / "web.service"
    alive.mkdir(parents=True)
    (alive / "cgroup.procs").write_text("4242\n")
    with scopes.holding("/system.slice/web.service", "cp1") as scope:
        assert scope is None
    with scopes.holding("/jobs/a", "cp1") as scope:
        assert scope is None
    (tmp_path / "run").rmdir()  # no systemd
    with scopes.holding("/system.slice/gone.service", "cp1") as scope:
        assert scope is None
    assert started == []


def test_systemd_run_failing_is_a_failed_restore_saying_why(tmp_path: Path) -> None:
    scopes, _ = fake_systemd(tmp_path, joins=False)
    with pytest.raises(RestoreFailed, match="Failed to start transient scope unit"), \
            scopes.holding("/system.slice/gone.service", "cp1"):
        pass
