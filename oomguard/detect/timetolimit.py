"""Time-to-limit (`time_to_limit`, `predict_from`): act when, at the cgroup's recent growth,
its limit comes before a checkpoint of the victim could finish. Watched (polled) once usage
passes `predict_from` of the limit, where the kernel wakes the daemon (a v1 mark). The dump
throughput comes from past dumps (oomguard.policy.forecast.updated_throughput)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oomguard.detect.base import CgroupReadings, Key, Settings
from oomguard.model.quantities import SHARE, boolean
from oomguard.model.units import format_size

TIME_TO_LIMIT = "time_to_limit"
PREDICT_FROM = "predict_from"

DEFAULT_THROUGHPUT = 200e6  # bytes/s: conservative until this machine has shown better
SAFETY_SECONDS = 0.5  # freeze, CRIU start, the parasite: what a dump costs before its first byte
MIN_SPAN = 0.05  # seconds of samples needed for a rate


@dataclass(frozen=True)
class Forecast:
    rate: float  # bytes/s (recent growth)
    seconds_to_limit: float  # at that rate; inf when not growing
    seconds_to_dump: float  # a checkpoint of the victim at the measured throughput
    act: bool

    def reason(self) -> str:
        return (f"growing {format_size(self.rate)}/s: the limit is {self.seconds_to_limit:.2f}s "
                f"away and a checkpoint takes ~{self.seconds_to_dump:.2f}s")


def growth_rate(samples: Sequence[tuple[float, int]]) -> float | None:
    """Least-squares slope of (time, usage) samples in bytes/s; None with too little data."""
    if len(samples) < 2 or samples[-1][0] - samples[0][0] < MIN_SPAN:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_u = sum(u for _, u in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return sum((t - mean_t) * (u - mean_u) for t, u in samples) / var


def forecast(samples: Sequence[tuple[float, int]], limit: int, victim_bytes: int,
             throughput: float = DEFAULT_THROUGHPUT,
             safety: float = SAFETY_SECONDS) -> Forecast | None:
    """None when there is no rate yet."""
    rate = growth_rate(samples)
    if rate is None:
        return None
    usage = samples[-1][1]
    to_limit = (limit - usage) / rate if rate > 0 else float("inf")
    to_dump = victim_bytes / max(throughput, 1.0) + safety
    return Forecast(rate=rate, seconds_to_limit=max(to_limit, 0.0), seconds_to_dump=to_dump,
                    act=rate > 0 and to_limit <= to_dump)


PREDICT_SAMPLES = 20  # the growth is measured over this many recent readings


@dataclass(frozen=True)
class GrowthHistory:
    """A guard's time-to-limit history, taken and returned by predict (the previous look's
    data, as systemd-oomd passes the previous tick's)."""

    predicting: bool = False  # usage is in the zone where growth is watched
    samples: tuple[tuple[float, int], ...] = ()  # recent (time, usage), once in that zone


def predict(history: GrowthHistory, now: float, usage: int, victim_bytes: int, limit: int,
            predict_from: float, throughput: float) -> tuple[str | None, GrowthHistory]:
    """Over `predict_from` of the limit, recent usage samples are kept and the verdict is to
    act (its reason) when, at the current growth, the limit comes before a checkpoint of
    `victim_bytes` could finish. Returns that reason (None: not now) and the new history."""
    if usage < limit * predict_from:
        return None, GrowthHistory()
    samples = (*history.samples, (now, usage))[-PREDICT_SAMPLES:]
    outlook = forecast(samples, limit, victim_bytes, throughput)
    if outlook is None or not outlook.act:
        return None, GrowthHistory(True, samples)
    return outlook.reason(), GrowthHistory(True, ())


class TimeToLimit:
    name: str = "time_to_limit"
    keys: tuple[Key, ...] = (Key(TIME_TO_LIMIT, boolean, False), Key(PREDICT_FROM, SHARE, 0.5))

    def judge(self, readings: CgroupReadings, settings: Settings,
              state: Any) -> tuple[str | None, Any]:
        history = state if isinstance(state, GrowthHistory) else GrowthHistory()
        limit = readings.limit_bytes
        if not settings[TIME_TO_LIMIT] or limit is None:
            return None, history
        return predict(history, readings.now, readings.usage_bytes, readings.anon_bytes, limit,
                       settings[PREDICT_FROM], readings.dump_throughput)

    def polls(self, state: Any) -> bool:
        return isinstance(state, GrowthHistory) and state.predicting

    def after_action(self, state: Any) -> Any:
        if not isinstance(state, GrowthHistory):
            return state
        return GrowthHistory(state.predicting, ())  # still watched; the old growth forgotten

    def watched_from(self, settings: Settings) -> float | None:
        return float(settings[PREDICT_FROM]) if settings[TIME_TO_LIMIT] else None

    def describe(self, settings: Settings) -> str | None:
        if not settings[TIME_TO_LIMIT]:
            return None
        return (f"earlier when growth would reach the limit first (watched from "
                f"{settings[PREDICT_FROM]:.0%})")


SIGNAL = TimeToLimit()
