"""Detections as plug-ins (issue 30, item 3): a system rule's reasons to act, and a cgroup
rule's beside its threshold, come from the modules of oomguard.detect, listed once in its
registry. Plug-ins written here (a PSI "some" avg60 window; anonymous memory over a share for
a few looks), which oomguard does not ship, are added with one registry line and nothing else:
the config file takes their keys with their kinds' hints, the startup line says them, the
daemon's look judges them and names their reason (the system rule's plug-ins after the first
reason are not asked: their readings are not taken), a cgroup plug-in keeps its own state
from look to look and is armed for where it starts watching."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.config.loading import GuardConfig, load_config_text
from oomguard.daemon.guardlines import guard_line
from oomguard.daemon.guards import SystemGuard
from oomguard.detect import registry
from oomguard.detect.base import CgroupReadings, Key, Settings, SystemReadings
from oomguard.detect.memavailable import MemAvailableFloor
from oomguard.detect.psifull import PsiFull
from oomguard.detect.timetolimit import GrowthHistory, TimeToLimit
from oomguard.model.errors import ConfigError
from oomguard.model.pressure import Pressure, PressureLine
from oomguard.model.quantities import SHARE
from oomguard.sense.systemlook import SystemLook
from tests.unit.test_loop import GiB, make_daemon

Memory = namedtuple("Memory", "total available")
SYSTEM = "[[guard]]\nsystem = true\n"


class PsiSomeAvg60:
    """The plug-in a user would add: act when some task waited on memory for this share of
    the last minute."""

    name: str = "psi_some_avg60"
    keys: tuple[Key, ...] = (Key("psi_some_avg60", SHARE, None),)

    def judge(self, readings: SystemReadings, settings: Settings) -> str | None:
        threshold = settings["psi_some_avg60"]
        pressure = readings.memory_pressure
        if threshold is None or pressure is None or pressure.some.avg60 / 100 < threshold:
            return None
        return f"memory pressure: some avg60 {pressure.some.avg60:.1f}% >= {threshold:.0%}"

    def describe(self, settings: Settings, mem_total: int) -> str | None:
        threshold = settings["psi_some_avg60"]
        return None if threshold is None else f"some avg60 reaches {threshold:.0%}"


@pytest.fixture
def with_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "SYSTEM_SIGNALS", (*registry.SYSTEM_SIGNALS, PsiSomeAvg60()))


def pressure_text(some_avg60: float = 0.0, full_avg10: float = 0.0) -> str:
    return (f"some avg10=0.00 avg60={some_avg60:.2f} avg300=0.00 total=1\n"
            f"full avg10={full_avg10:.2f} avg60=0.00 avg300=0.00 total=1\n")


class Readings:
    """A look's readings, counting what was read."""

    def __init__(self, available: int, total: int, pressure: Pressure | None) -> None:
        self.available, self.total = available, total
        self._pressure = pressure
        self.pressure_reads = 0

    @property
    def memory_pressure(self) -> Pressure | None:
        self.pressure_reads += 1
        return self._pressure


def test_the_shipped_plugins_are_the_floor_then_full_pressure() -> None:
    names = [signal.name for signal in registry.SYSTEM_SIGNALS]
    assert names == ["memavailable", "psi_full"]
    assert [signal.name for signal in registry.CGROUP_SIGNALS] == ["time_to_limit"]
    assert [signal.name for signal in registry.GPU_SIGNALS] == ["gpu_threshold"]
    assert [key.name for key in registry.keys_of()] == [
        "min_available", "psi_full_avg10", "time_to_limit", "predict_from", "gpu_threshold"]
    assert registry.defaults() == {"min_available": 0.10, "psi_full_avg10": None,
                                   "time_to_limit": False, "predict_from": 0.5,
                                   "gpu_threshold": None}


def test_a_rule_holds_every_plugins_key_at_its_value_or_default() -> None:
    spec = load_config_text(SYSTEM + 'min_available = "2G"\n', "c.toml").guards[0]
    assert spec.signal_settings() == {"min_available": 2 * GiB, "psi_full_avg10": None,
                                      "time_to_limit": False, "predict_from": 0.5,
                                      "gpu_threshold": None}
    assert spec.min_available == 2 * GiB
    assert spec == GuardConfig(cgroups=(), system=True, signals=(("min_available", 2 * GiB),))
    with pytest.raises(ValueError, match="no detection plug-in has the key 'min_avail'"):
        GuardConfig(cgroups=(), system=True, signals=(("min_avail", 0.2),))


def test_a_misspelt_plugin_key_is_named_with_the_nearest_one() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(SYSTEM + 'min_avaliable = "5%"\n', "c.toml")
    (issue,) = caught.value.issues
    assert issue.key == "guard[0].min_avaliable"
    assert "did you mean 'min_available'?" in issue.reason


def test_the_floor_fires_first_and_pressure_is_then_not_read() -> None:
    settings = {"min_available": 0.10, "psi_full_avg10": 0.5}
    low = Readings(available=GiB, total=16 * GiB, pressure=None)
    reason = registry.first_reason(low, settings)
    assert reason == "MemAvailable 1.0GiB at or below the floor (10% of MemTotal)"
    assert low.pressure_reads == 0
    full = Pressure(PressureLine(0, 0, 0, 1), PressureLine(62.5, 0, 0, 1))
    pressed = Readings(available=8 * GiB, total=16 * GiB, pressure=full)
    assert registry.first_reason(pressed, settings) == (
        "memory pressure: full avg10 62.5% >= 50%")
    off = Readings(available=8 * GiB, total=16 * GiB, pressure=full)
    assert registry.first_reason(off, {**settings, "psi_full_avg10": None}) is None
    assert off.pressure_reads == 0  # a plug-in left off reads nothing


def test_a_look_reads_the_pressure_file_once_and_copes_without_psi(tmp_path: Path) -> None:
    path = tmp_path / "memory"
    path.write_text(pressure_text(full_avg10=12.5))
    look = SystemLook(Memory(16 * GiB, 4 * GiB), path)
    assert (look.available, look.total) == (4 * GiB, 16 * GiB)
    assert look.memory_pressure is not None and look.memory_pressure.full is not None
    path.write_text(pressure_text(full_avg10=99.0))  # the look keeps what it read
    assert look.memory_pressure.full.avg10 == 12.5
    assert SystemLook(Memory(1, 1), tmp_path / "absent").memory_pressure is None
    path.write_text("garbage\n")
    assert SystemLook(Memory(1, 1), path).memory_pressure is None
    assert PsiFull().judge(SystemLook(Memory(16 * GiB, 8 * GiB), path),
                           {"psi_full_avg10": 0.1}) is None


def test_a_new_plugin_is_one_registry_line_config_and_startup_line(with_plugin: None) -> None:
    spec = load_config_text(SYSTEM + 'psi_some_avg60 = "30%"\n', "c.toml").guards[0]
    assert spec.signal_settings()["psi_some_avg60"] == 0.30
    with pytest.raises(ConfigError) as caught:  # its kind's hint, as for any share
        load_config_text(SYSTEM + "psi_some_avg60 = 30\n", "c.toml")
    assert caught.value.issues[0].key == "guard[0].psi_some_avg60"
    assert 'did you mean "30%"?' in caught.value.issues[0].reason
    line = guard_line(SystemGuard(spec=spec, detection="MemAvailable (adaptive polling)"),
                      None, 32 * GiB)
    assert "at or below 10% of 32.0 GiB (3.2 GiB) or some avg60 reaches 30%" in line


def test_the_daemon_acts_on_a_new_plugins_reason(with_plugin: None, tmp_path: Path) -> None:
    """Through the daemon's own look: the plug-in's reason is the crossing's (a dry run, on
    the processes of a cgroup that does not exist: nothing is touched)."""
    pressure = tmp_path / "pressure"
    pressure.write_text(pressure_text(some_avg60=5.0))
    rule = (SYSTEM + 'psi_some_avg60 = "40%"\n'
            f'victim_cgroups = ["{tmp_path}/no-such-cgroup"]\n')
    daemon, _clock, epoll, log, _memory = make_daemon(
        tmp_path, rule, rescan="1h", available=12 * GiB, daemon_keys="dry_run = true\n")
    try:
        daemon.examiner.pressure_file = pressure
        daemon.arm()
        daemon.tick()
        assert not log.named("threshold.crossed")  # 5% of the last minute: under 40%
        pressure.write_text(pressure_text(some_avg60=45.0))  # read afresh at the next look
        daemon.tick()
        daemon.actor.join(10)
        assert epoll.timeouts == [0.0, 1.0]  # a look at once, the next a second later
        crossed = log.named("threshold.crossed")
        assert len(crossed) == 1 and crossed[0]["cgroup"] == "system", log.events
        assert crossed[0]["reason"] == "memory pressure: some avg60 45.0% >= 40%"
        assert log.named("victim.none")  # nothing in the (absent) victim cgroup
    finally:
        daemon.close()


def test_the_floor_and_full_pressure_say_what_they_watch() -> None:
    assert MemAvailableFloor().describe({"min_available": 512 << 20}, 32 * GiB) == (
        "MemAvailable is at or below 512 MiB")
    assert PsiFull().describe({"psi_full_avg10": None}, 32 * GiB) is None


# -- the cgroup rules' plug-ins (beside the threshold) ---------------------------------------------

class AnonCount:
    """A cgroup plug-in a user would add: act once anonymous memory has been over a share of
    the limit for `anon_looks` looks in a row (its state: the looks counted so far), watched
    from that share on (polled meanwhile)."""

    name: str = "anon_count"
    keys: tuple[Key, ...] = (Key("anon_share", SHARE, None), Key("anon_looks", int, 3))

    def judge(self, readings: CgroupReadings, settings: Settings,
              state: Any) -> tuple[str | None, Any]:
        share, limit = settings["anon_share"], readings.limit_bytes
        if share is None or limit is None or readings.anon_bytes < limit * share:
            return None, 0
        looks = (state or 0) + 1
        if looks < settings["anon_looks"]:
            return None, looks
        return f"anonymous memory over {share:.0%} for {looks} looks", looks

    def polls(self, state: Any) -> bool:
        return bool(state)

    def after_action(self, state: Any) -> Any:
        return 0

    def watched_from(self, settings: Settings) -> float | None:
        share: float | None = settings["anon_share"]
        return share

    def describe(self, settings: Settings) -> str | None:
        share = settings["anon_share"]
        return None if share is None else f"or when anonymous memory stays over {share:.0%}"


@dataclass(frozen=True)
class Look:
    usage_bytes: int
    anon_bytes: int
    limit_bytes: int | None
    now: float = 0.0
    dump_throughput: float = 200e6


@pytest.fixture
def with_cgroup_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "CGROUP_SIGNALS", (*registry.CGROUP_SIGNALS, AnonCount()))


def test_a_new_cgroup_plugin_keeps_its_state_from_look_to_look(
        with_cgroup_plugin: None) -> None:
    spec = load_config_text('[[guard]]\ncgroup = "/jobs/a"\nanon_share = "60%"\n'
                            "anon_looks = 2\n", "c.toml").guards[0]
    settings = spec.signal_settings()
    over = Look(usage_bytes=700, anon_bytes=650, limit_bytes=1000)
    fired, reason, states = registry.judge_cgroup(over, settings, {})
    assert (fired, reason) == (None, None) and states["anon_count"] == 1
    assert any(signal.polls(states.get(signal.name)) for signal in registry.cgroup_signals())
    fired, reason, states = registry.judge_cgroup(over, settings, states)
    assert isinstance(fired, AnonCount) and reason == "anonymous memory over 60% for 2 looks"
    under = Look(usage_bytes=700, anon_bytes=100, limit_bytes=1000)
    assert registry.judge_cgroup(under, settings, states)[2]["anon_count"] == 0
    # time-to-limit judged beside it, its history kept under its own name
    assert states["time_to_limit"] == GrowthHistory()


def test_a_new_cgroup_plugin_is_armed_for_and_said_at_start(with_cgroup_plugin: None) -> None:
    from oomguard.cgroup.watch import threshold_marks, v1_marks

    spec = load_config_text('[[guard]]\ncgroup = "/jobs/a"\nthreshold = "90%"\n'
                            'anon_share = "60%"\n', "c.toml").guards[0]
    guard = SimpleNamespace(spec=spec)
    first, later = v1_marks(guard, 1000 << 20)  # type: ignore[arg-type]
    assert first == [int((1000 << 20) * 0.6), threshold_marks(1000 << 20, 0.9)[0]]
    assert later == threshold_marks(1000 << 20, 0.9)[1:]
    assert registry.cgroup_descriptions(spec.signal_settings()) == [
        "or when anonymous memory stays over 60%"]


def test_time_to_limit_is_the_shipped_cgroup_plugin() -> None:
    plugin = TimeToLimit()
    settings = {"time_to_limit": True, "predict_from": 0.5}
    mib = 1 << 20
    reason, history = plugin.judge(Look(600 * mib, 500 * mib, 1000 * mib, now=0.0), settings,
                                   None)
    assert reason is None and plugin.polls(history) and plugin.watched_from(settings) == 0.5
    reason, history = plugin.judge(Look(990 * mib, 900 * mib, 1000 * mib, now=0.1), settings,
                                   history)
    assert reason is not None and reason.startswith("growing ")
    assert plugin.after_action(history) == GrowthHistory(True, ())
    off = {"time_to_limit": False, "predict_from": 0.5}
    assert plugin.judge(Look(990 * mib, 900 * mib, 1000 * mib), off, None)[0] is None
    assert plugin.watched_from(off) is None and plugin.describe(off) is None
