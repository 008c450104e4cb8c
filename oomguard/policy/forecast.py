"""Time-to-limit: act when the limit will be reached before a checkpoint of the victim could
finish. Pure functions of usage samples; the dump throughput comes from past dumps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.model.units import format_size

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


def updated_throughput(previous: float, image_bytes: int, dump_seconds: float,
                       weight: float = 0.3) -> float:
    """An exponentially weighted mean of measured dump throughputs (bytes/s)."""
    if dump_seconds <= 0 or image_bytes <= 0:
        return previous
    measured = image_bytes / dump_seconds
    return measured if previous <= 0 else (1 - weight) * previous + weight * measured


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
