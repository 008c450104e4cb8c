"""Time-to-limit (oomguard.detect.timetolimit): growth rate and forecast; the dump throughput
estimate (oomguard.policy.forecast)."""

from __future__ import annotations

import math
import random

import pytest

from oomguard.detect.timetolimit import (
    DEFAULT_THROUGHPUT,
    MIN_SPAN,
    SAFETY_SECONDS,
    Forecast,
    forecast,
    growth_rate,
)
from oomguard.policy.forecast import updated_throughput

MB = 1_000_000
MiB = 1 << 20


def linear(rate: float, *, start: int = 0, t0: float = 0.0, step: float = 0.25,
           n: int = 5) -> list[tuple[float, int]]:
    """n samples `step` seconds apart growing at `rate` bytes/s (times exact in binary)."""
    return [(t0 + i * step, int(start + rate * i * step)) for i in range(n)]


# --- growth_rate ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        (linear(100 * MB), 100 * MB),
        (linear(100 * MB, start=3_000_000_000, t0=1000.0), 100 * MB),
        (linear(1 * MB, n=2, step=1.0), 1 * MB),
        (linear(-50 * MB, start=1_000_000_000), -50 * MB),
        (linear(0, start=123 * MB), 0.0),
        ([(0.0, 0), (0.5, 50 * MB), (1.0, 100 * MB)], 100 * MB),
    ],
)
def test_growth_rate_exact_on_linear_samples(samples: list[tuple[float, int]],
                                             expected: float) -> None:
    assert growth_rate(samples) == pytest.approx(expected, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize(
    "samples",
    [
        [],
        [(0.0, 100)],
        [(0.0, 0), (0.04, 10 * MB)],  # span under MIN_SPAN
        [(5.0, 0), (5.01, 1 * MB), (5.03, 2 * MB)],
        [(1.0, 0), (1.0, 1 * MB)],  # no time passed
    ],
)
def test_growth_rate_none_with_too_little_data(samples: list[tuple[float, int]]) -> None:
    assert growth_rate(samples) is None


def test_growth_rate_span_just_above_min_span() -> None:
    assert MIN_SPAN == 0.05
    rate = growth_rate([(0.0, 0), (0.0625, 1 * MB)])
    assert rate == pytest.approx(16 * MB)


def test_growth_rate_negative_when_shrinking() -> None:
    rate = growth_rate([(0.0, 900 * MB), (0.5, 800 * MB), (1.0, 700 * MB)])
    assert rate is not None and rate < 0
    assert rate == pytest.approx(-200 * MB)


def test_growth_rate_least_squares_is_robust_to_noise() -> None:
    rng = random.Random(1234)
    true_rate = 100 * MB
    samples = [(i * 0.05, int(2_000 * MB + true_rate * i * 0.05 + rng.uniform(-2, 2) * MB))
               for i in range(41)]  # 2 s of samples, +-2 MB of jitter each
    rate = growth_rate(samples)
    assert rate == pytest.approx(true_rate, rel=0.01)


# --- forecast ------------------------------------------------------------------------------------

GROWING_100 = [(0.0, 1_000 * MB), (0.5, 1_050 * MB), (1.0, 1_100 * MB)]  # 100 MB/s, now 1100 MB


@pytest.mark.parametrize(
    ("case", "samples", "limit", "victim", "kwargs", "act", "to_limit", "to_dump"),
    [
        # limit 140 MB away at 100 MB/s = 1.4 s; dumping 200 MB at 200 MB/s + 0.5 s = 1.5 s
        ("fast grower", GROWING_100, 1_240 * MB, 200 * MB, {}, True, 1.4, 1.5),
        ("exactly at the boundary", GROWING_100, 1_250 * MB, 200 * MB, {}, True, 1.5, 1.5),
        ("slow grower", linear(1 * MB, start=1_000 * MB), 2_000 * MB, 200 * MB, {},
         False, 999.0, 1.5),
        ("limit just beyond the dump", GROWING_100, 1_260 * MB, 200 * MB, {}, False, 1.6, 1.5),
        ("faster disk: no need yet", GROWING_100, 1_240 * MB, 200 * MB,
         {"throughput": 400 * MB}, False, 1.4, 1.0),
        ("slower disk: act earlier", GROWING_100, 1_340 * MB, 200 * MB,
         {"throughput": 100 * MB}, True, 2.4, 2.5),
        ("no safety margin", GROWING_100, 1_240 * MB, 200 * MB, {"safety": 0.0}, False, 1.4, 1.0),
        ("larger safety margin", GROWING_100, 1_260 * MB, 200 * MB, {"safety": 1.0},
         True, 1.6, 2.0),
        ("throughput floored at 1 B/s", GROWING_100, 1_240 * MB, 100, {"throughput": 0.0},
         True, 1.4, 100.5),
    ],
)
def test_forecast_table(case: str, samples: list[tuple[float, int]], limit: int, victim: int,
                        kwargs: dict[str, float], act: bool, to_limit: float,
                        to_dump: float) -> None:
    result = forecast(samples, limit, victim, **kwargs)
    assert result is not None, case
    assert result.act is act, case
    assert result.seconds_to_limit == pytest.approx(to_limit), case
    assert result.seconds_to_dump == pytest.approx(to_dump), case


def test_forecast_defaults() -> None:
    assert DEFAULT_THROUGHPUT == 200e6
    assert SAFETY_SECONDS == 0.5
    result = forecast(GROWING_100, 10_000 * MB, 400 * MB)
    assert result is not None
    assert result.seconds_to_dump == pytest.approx(400 * MB / DEFAULT_THROUGHPUT + SAFETY_SECONDS)


def test_forecast_reason_of_a_fast_grower() -> None:
    result = forecast(GROWING_100, 1_240 * MB, 200 * MB)
    assert result is not None and result.act
    reason = result.reason()
    assert reason == ("growing 95.4MiB/s: the limit is 1.40s away and a checkpoint takes "
                      "~1.50s")


@pytest.mark.parametrize(
    "samples",
    [
        [(0.0, 900 * MB), (0.5, 850 * MB), (1.0, 800 * MB)],  # shrinking
        [(0.0, 900 * MB), (0.5, 900 * MB), (1.0, 900 * MB)],  # flat
    ],
)
def test_forecast_not_growing_never_acts(samples: list[tuple[float, int]]) -> None:
    result = forecast(samples, 1_000 * MB, 500 * MB)
    assert result is not None
    assert math.isinf(result.seconds_to_limit) and result.seconds_to_limit > 0
    assert result.act is False
    assert result.rate <= 0


def test_forecast_already_past_the_limit() -> None:
    samples = [(0.0, 1_100 * MB), (0.5, 1_150 * MB), (1.0, 1_200 * MB)]
    result = forecast(samples, 1_000 * MB, 10 * MB)
    assert result is not None
    assert result.seconds_to_limit == 0.0
    assert result.act is True


def test_forecast_at_the_limit_and_growing_acts() -> None:
    result = forecast(GROWING_100, 1_100 * MB, 1 * MB)
    assert result is not None
    assert result.seconds_to_limit == 0.0 and result.act is True


@pytest.mark.parametrize("samples", [[], [(0.0, MB)], [(0.0, 0), (0.01, MB)]])
def test_forecast_none_without_a_rate(samples: list[tuple[float, int]]) -> None:
    assert forecast(samples, 1_000 * MB, 100 * MB) is None


def test_forecast_is_a_frozen_value() -> None:
    result = forecast(GROWING_100, 1_240 * MB, 200 * MB)
    assert isinstance(result, Forecast)
    assert result.rate == pytest.approx(100 * MB)
    with pytest.raises(AttributeError):
        result.act = False  # type: ignore[misc]


# --- updated_throughput --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("previous", "image_bytes", "seconds", "kwargs", "expected"),
    [
        # the first measurement replaces a non-positive previous estimate
        (0.0, 400 * MB, 2.0, {}, 200 * MB),
        (-1.0, 300 * MB, 1.0, {}, 300 * MB),
        # EWMA, weight 0.3: 0.7 * 100 + 0.3 * 200
        (100 * MB, 400 * MB, 2.0, {}, 130 * MB),
        (200 * MB, 100 * MB, 1.0, {}, 170 * MB),
        (100 * MB, 400 * MB, 2.0, {"weight": 0.5}, 150 * MB),
        (100 * MB, 400 * MB, 2.0, {"weight": 1.0}, 200 * MB),
        # nothing measured: keep the previous estimate
        (150 * MB, 400 * MB, 0.0, {}, 150 * MB),
        (150 * MB, 400 * MB, -1.0, {}, 150 * MB),
        (150 * MB, 0, 2.0, {}, 150 * MB),
        (150 * MB, -5, 2.0, {}, 150 * MB),
        (0.0, 0, 0.0, {}, 0.0),
    ],
)
def test_updated_throughput(previous: float, image_bytes: int, seconds: float,
                            kwargs: dict[str, float], expected: float) -> None:
    assert updated_throughput(previous, image_bytes, seconds, **kwargs) == pytest.approx(
        expected, rel=1e-12)


# -- the guard's history as a value (policy.forecast.predict, policy.pressure.watch_next) -------

def test_predict_takes_the_history_and_returns_the_next() -> None:
    from oomguard.detect.timetolimit import PREDICT_SAMPLES, GrowthHistory, predict

    limit, mib = 1000 * MiB, MiB
    below = predict(GrowthHistory(True, ((0.0, 1),)), 1.0, 500 * mib, 0, limit, 0.8, 200e6)
    assert below == (None, GrowthHistory())  # out of the zone: the history goes
    history = GrowthHistory()
    for i in range(PREDICT_SAMPLES + 5):  # slow growth: kept, never more than the window
        reason, history = predict(history, i * 1.0, 800 * mib + i * mib, 10 * mib, limit,
                                  0.8, 200e6)
        assert reason is None and history.predicting
    assert len(history.samples) == PREDICT_SAMPLES and history.samples[-1][0] == 24.0
    # Fast growth with a large victim: act, and start afresh.
    fast = GrowthHistory(True, ((0.0, 900 * mib),))
    reason, after = predict(fast, 0.1, 950 * mib, 900 * mib, limit, 0.8, 200e6)
    assert reason is not None and "growing" in reason and after == GrowthHistory(True, ())
    assert fast.samples == ((0.0, 900 * mib),)  # the value taken is not changed


def test_watch_next_carries_the_last_reading_and_the_backed_off_interval() -> None:
    from oomguard.policy.pressure import CacheWatch, next_watch_look, watch_baseline, watch_next

    first_delay, first = watch_next(CacheWatch(), 10.0, 100 * MiB, 200 * MiB, False, 1.0)
    assert first.sample == (10.0, 100 * MiB)
    assert first_delay == next_watch_look(10.0, 100 * MiB, 200 * MiB, None, 0.0, 1.0).delay
    delay, later = watch_next(first, 10.5, 100 * MiB, 200 * MiB, False, 1.0)  # not growing
    look = next_watch_look(10.5, 100 * MiB, 200 * MiB, watch_baseline(first.sample, 10.5, False),
                           first.interval, 1.0)
    assert (delay, later) == (look.delay, CacheWatch((10.5, 100 * MiB), look.idle_interval))
