"""oomguard.daemon.guards: threshold marks, the PSI trigger this process may use, system-guard arming."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.cgroup.watch import PSI, Replaced, threshold_marks
from oomguard.config.loading import GuardConfig
from oomguard.daemon.guards import CgroupGuard, SystemGuard, arm_system, psi_trigger_for
from oomguard.store.names import SAVED_HIGH
from tests.unit._support import MiB

# -- threshold_marks -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("limit", "threshold", "marks"),
    [
        # 256 MiB at 85%: the threshold, then 1/16 and 1/2 of the way to the limit
        (256 * MiB, 0.85, [int(256 * MiB * (0.85 + 0.15 * k / 16)) for k in (0, 1, 8)]),
        (256 * MiB, 0.85, [228170137, 230686720, 248302796]),
        (256 * MiB, 1.0, [256 * MiB]),  # every mark at the limit: one
        (1600, 0.5, [800, 850, 1200]),
        (1000, 0.9, [900, 906, 950]),
        (100, 0.99, [99]),  # 99.0, 99.06, 99.5 collapse
    ],
    ids=["256M-85%", "256M-85%-literal", "100%", "1600-50%", "1000-90%", "collapse"],
)
def test_threshold_marks(limit: int, threshold: float, marks: list[int]) -> None:
    got = threshold_marks(limit, threshold)
    assert got == marks
    assert got == sorted(set(got))
    assert all(0 < m <= limit for m in got)


# -- psi_trigger_for -----------------------------------------------------------------------------

def _proc_root(root: Path, cap_eff: str | None) -> Path:
    (root / "self").mkdir(parents=True)
    if cap_eff is not None:
        (root / "self" / "status").write_text(
            f"Name:\toomguard\nUid:\t0\t0\t0\t0\nCapPrm:\t{cap_eff}\nCapEff:\t{cap_eff}\n")
    return root


@pytest.mark.parametrize(
    ("cap_eff", "trigger"),
    [
        ("000001ffffffffff", "some 50000 500000"),  # CAP_SYS_RESOURCE: 500 ms window
        ("0000000001000000", "some 50000 500000"),
        ("000001fffeffffff", "some 200000 2000000"),  # without: 2 s window
        ("0000000000000000", "some 200000 2000000"),
        (None, "some 200000 2000000"),  # self/status unreadable: assume unprivileged
    ],
    ids=["root", "only-sys-resource", "root-minus-sys-resource", "user", "no-status"],
)
def test_psi_trigger_for(tmp_path: Path, cap_eff: str | None, trigger: str) -> None:
    assert psi_trigger_for(str(_proc_root(tmp_path / "proc", cap_eff))) == trigger


def test_psi_trigger_for_missing_proc_root(tmp_path: Path) -> None:
    assert psi_trigger_for(str(tmp_path / "nothing")) == "some 200000 2000000"


def test_psi_trigger_for_status_without_capeff(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    (root / "self").mkdir(parents=True)
    (root / "self" / "status").write_text("Name:\tx\nUid:\t0\t0\t0\t0\n")
    assert psi_trigger_for(str(root)) == "some 200000 2000000"


# -- arm_system (a regular file stands in for /proc/pressure/memory) -----------------------------

def _system_guard(psi: bool = True) -> SystemGuard:
    return SystemGuard(spec=GuardConfig(cgroups=(), system=True, psi=psi))


def test_arm_system_registers_psi_trigger(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    pressure = tmp_path / "pressure" / "memory"
    pressure.write_bytes(b"")
    guard = _system_guard()
    arm_system(guard, "some 200000 2000000", proc_root=str(tmp_path))
    try:
        assert list(guard.fds.values()) == [PSI]
        assert guard.detection == ("MemAvailable (adaptive polling) + "
                                   "PSI 'some 200000 2000000' on /proc/pressure/memory")
        assert pressure.read_bytes() == b"some 200000 2000000\0"
    finally:
        for fd in guard.fds:
            os.close(fd)


@pytest.mark.parametrize("psi", [True, False], ids=["no-pressure-file", "psi-off"])
def test_arm_system_falls_back_to_polling(tmp_path: Path, psi: bool) -> None:
    if not psi:
        (tmp_path / "pressure").mkdir()
        (tmp_path / "pressure" / "memory").write_bytes(b"")
    guard = _system_guard(psi)
    arm_system(guard, "some 200000 2000000", proc_root=str(tmp_path))
    assert guard.fds == {}
    assert guard.detection == "MemAvailable (adaptive polling)"
    if not psi:
        assert (tmp_path / "pressure" / "memory").read_bytes() == b""  # nothing written


# -- settings a dead run left behind ----------------------------------------------------------

def test_put_back_leftovers_restores_only_what_no_armed_guard_holds(tmp_path: Path) -> None:
    from oomguard.cgroup.v1 import V1MemoryCgroup
    from oomguard.cgroup.v2 import V2MemoryCgroup
    from oomguard.cgroup.watch import OOM_KILL_KEY
    from oomguard.daemon.guards import claimed_keys, put_back_leftovers
    from oomguard.store.ledger import SavedLimits

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for name in ("kept", "dropped", "gone"):
        (v1 / name).mkdir(parents=True)
        (v2 / name).mkdir(parents=True)
        (v1 / name / "memory.oom_control").write_text("1")  # as the dead run left them
        (v2 / name / "memory.high").write_text("200")
    (v1 / "gone" / "memory.oom_control").unlink()
    (v1 / "gone").rmdir()
    saved = SavedLimits(tmp_path / SAVED_HIGH)
    for name in ("kept", "dropped", "gone"):
        saved.remember(str(v1 / name) + OOM_KILL_KEY, 0)
    saved.remember(str(v2 / "dropped"), None)
    saved.remember(str(v2 / "kept"), 300)

    def open_path(path: str) -> V1MemoryCgroup | V2MemoryCgroup:
        return V1MemoryCgroup(path, v1) if path.startswith(str(v1)) else V2MemoryCgroup(path, v2)

    kept_v1 = CgroupGuard(spec=GuardConfig(cgroups=()), cgroup=open_path(str(v1 / "kept")),
                          replaced=Replaced(oom_disable_changed=True))
    kept_v2 = CgroupGuard(spec=GuardConfig(cgroups=()), cgroup=open_path(str(v2 / "kept")),
                          replaced=Replaced(high_changed=True))
    unchanged = CgroupGuard(spec=GuardConfig(cgroups=()), cgroup=open_path(str(v1 / "dropped")))
    claimed = claimed_keys([kept_v1, kept_v2, unchanged])
    assert claimed == {str(v1 / "kept") + OOM_KILL_KEY, str(v2 / "kept")}
    done = put_back_leftovers(saved, claimed, open_path)
    assert sorted(done) == [(str(v1 / "dropped"), "oom_kill_disable 0"),
                            (str(v2 / "dropped"), "memory.high max")]
    assert (v1 / "dropped" / "memory.oom_control").read_text() == "0"
    assert (v2 / "dropped" / "memory.high").read_text() == "max"
    assert (v1 / "kept" / "memory.oom_control").read_text() == "1"  # the armed guard's
    assert (v2 / "kept" / "memory.high").read_text() == "200"
    assert saved.items() == {str(v1 / "kept") + OOM_KILL_KEY: 0, str(v2 / "kept"): 300}


@pytest.mark.parametrize("count", [1, 9, 10, 160, 161, 1000, 5000])
def test_the_safety_rescan_looks_at_every_guard_a_few_at_a_time(count: int) -> None:
    """With inotify at work: at most SWEEP_MOST limit files stat'ed per rescan, each guard
    within max(SWEEP_SLICES, count / SWEEP_MOST) rescans."""
    from oomguard.daemon.cgroupchanges import SWEEP_MOST, SWEEP_SLICES, sweep_slice

    guards = list(range(count))
    rounds = max(SWEEP_SLICES, -(-count // SWEEP_MOST))
    seen: list[int] = []
    turn = 0
    for _ in range(rounds):
        looked, turn = sweep_slice(guards, turn)  # type: ignore[arg-type]
        assert len(looked) <= SWEEP_MOST
        seen += looked  # type: ignore[arg-type]
    assert sorted(seen) == guards


def test_recent_takebacks_keep_the_window_and_count_this_one() -> None:
    from oomguard.daemon.guardarming import HIGH_TAKEBACK_WINDOW, recent_takebacks

    times: tuple[float, ...] = ()
    for at in (0.0, 10.0, 20.0):
        times = recent_takebacks(times, at)
    assert times == (0.0, 10.0, 20.0)
    assert recent_takebacks(times, HIGH_TAKEBACK_WINDOW + 5.0) == (10.0, 20.0,
                                                                  HIGH_TAKEBACK_WINDOW + 5.0)
    assert recent_takebacks(times, 10_000.0) == (10_000.0,)
