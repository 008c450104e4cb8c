"""oomguard.model.units: sizes, durations, fractions people write, and sizes shown to people."""

from __future__ import annotations

import pytest

from oomguard.model.units import format_size, parse_duration, parse_fraction, parse_size

K, M, G, T, P = (1024 ** i for i in range(1, 6))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("512M", 512 * M),
        ("2GiB", 2 * G),
        ("2GB", 2 * G),  # binary either way, as the kernel's files
        ("2G", 2 * G),
        ("1.5G", 3 * G // 2),
        ("0.5K", 512),
        ("4096", 4096),
        ("4096B", 4096),
        ("64k", 64 * K),
        ("64KiB", 64 * K),
        ("64 KiB", 64 * K),
        ("  1T  ", T),
        ("1P", P),
        ("2gib", 2 * G),
        ("0", 0),
        (4096, 4096),
        (0, 0),
        (1 << 40, 1 << 40),
    ],
)
def test_parse_size(value: str | int, expected: int) -> None:
    result = parse_size(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "expected a size"),
        ("M", "expected a size"),
        ("abc", "expected a size"),
        ("12X", "expected a size"),
        ("1E", "expected a size"),
        ("-1M", "expected a size"),
        ("1,5G", "expected a size"),
        ("1 2M", "expected a size"),
        ("1e3", "expected a size"),
        ("2 GiBs", "expected a size"),
        (-1, "cannot be negative"),
        (True, "expected a size"),
        (False, "expected a size"),
    ],
    ids=repr,
)
def test_parse_size_rejects(value: str | int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("150ms", 0.15),
        ("100ms", 0.1),
        ("2s", 2.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("10", 10.0),  # no unit: seconds
        (" 2s ", 2.0),
        ("0s", 0.0),
        (3, 3.0),
        (0.25, 0.25),
        (0, 0.0),
    ],
)
def test_parse_duration(value: str | float, expected: float) -> None:
    result = parse_duration(value)
    assert result == pytest.approx(expected)
    assert type(result) is float


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "expected a duration"),
        ("fast", "expected a duration"),
        ("2 min", "expected a duration"),
        ("2S", "expected a duration"),  # units are case-sensitive: M would be ambiguous
        ("-1s", "expected a duration"),
        ("1w", "expected a duration"),
        (-1, "cannot be negative"),
        (-0.5, "cannot be negative"),
        (True, "expected a duration"),
    ],
    ids=repr,
)
def test_parse_duration_rejects(value: str | float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(value)


def test_parse_duration_rejects_nan() -> None:
    with pytest.raises(ValueError):
        parse_duration(float("nan"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("85%", 0.85),
        (" 85% ", 0.85),
        ("100%", 1.0),
        ("0.5%", 0.005),
        ("0.85", 0.85),
        (0.85, 0.85),
        (1, 1.0),
        (1.0, 1.0),
    ],
)
def test_parse_fraction(value: str | float, expected: float) -> None:
    assert parse_fraction(value) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0%", "must be above 0% and at most 100%"),
        ("150%", "must be above 0% and at most 100%"),
        ("85", "must be above 0% and at most 100%"),  # 85 as a plain number is 8500%
        ("-5%", "must be above 0% and at most 100%"),
        (0, "must be above 0% and at most 100%"),
        (1.5, "must be above 0% and at most 100%"),
        (float("nan"), "must be above 0% and at most 100%"),
        ("abc", "expected a percentage"),
        ("%", "expected a percentage"),
        ("", "expected a percentage"),
        ("85%%", "expected a percentage"),
        (True, "expected a percentage"),
    ],
    ids=repr,
)
def test_parse_fraction_rejects(value: str | float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fraction(value)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (M, "1.0MiB"),
        (512 * M, "512.0MiB"),
        (3 * G // 2, "1.5GiB"),
        (T, "1.0TiB"),
        (P, "1024.0TiB"),  # TiB is the largest unit
        (-2048, "-2.0KiB"),
        (1.5 * M, "1.5MiB"),
    ],
)
def test_format_size(n: float, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("text", ["512M", "2GiB", "1.5G", "64K", "1T"])
def test_size_round_trip(text: str) -> None:
    assert parse_size(format_size(parse_size(text)).replace(".0", "")) == parse_size(text)
