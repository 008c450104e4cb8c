"""oomguard.config.actions: parsing one action step and a whole action chain."""

from __future__ import annotations

import signal

import pytest

from oomguard.config.actions import (
    CHECKPOINT,
    DEFAULT_CHAIN,
    FREEZE,
    KILL,
    PAGEOUT,
    SIGNAL,
    Step,
    parse_chain,
    parse_step,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("freeze", Step(FREEZE)),
        ("checkpoint", Step(CHECKPOINT)),
        ("kill", Step(KILL)),
        ("FREEZE", Step(FREEZE)),
        ("Checkpoint", Step(CHECKPOINT)),
        ("KiLL", Step(KILL)),
        ("  checkpoint  ", Step(CHECKPOINT)),
        ("signal:SIGUSR1:30s", Step(SIGNAL, signal.SIGUSR1, 30.0)),
        ("signal:USR1:500ms", Step(SIGNAL, signal.SIGUSR1, 0.5)),
        ("signal:sigusr2:1m", Step(SIGNAL, signal.SIGUSR2, 60.0)),
        ("SIGNAL:term:1s", Step(SIGNAL, signal.SIGTERM, 1.0)),
        ("signal:SIGTERM:2", Step(SIGNAL, signal.SIGTERM, 2.0)),
        ("signal:INT:0.25", Step(SIGNAL, signal.SIGINT, 0.25)),
        ("signal:SIGHUP:1h", Step(SIGNAL, signal.SIGHUP, 3600.0)),
    ],
)
def test_parse_step_valid(text: str, expected: Step) -> None:
    assert parse_step(text) == expected


def test_signal_step_holds_the_signal_number() -> None:
    step = parse_step("signal:SIGUSR1:30s")
    assert step.signal == int(signal.SIGUSR1)
    assert step.grace == 30.0
    assert parse_step("checkpoint").signal == 0
    assert parse_step("checkpoint").grace == 0.0


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("freeze", "freeze"),
        ("CHECKPOINT", "checkpoint"),
        ("kill", "kill"),
        ("signal:SIGUSR1:30s", "signal:SIGUSR1:30s"),
        ("signal:USR1:500ms", "signal:SIGUSR1:0.5s"),
        ("signal:SIGTERM:2", "signal:SIGTERM:2s"),
        ("signal:usr2:1m", "signal:SIGUSR2:60s"),
        ("signal:SIGINT:1h", "signal:SIGINT:3600s"),
    ],
)
def test_str_round_trip(text: str, shown: str) -> None:
    step = parse_step(text)
    assert str(step) == shown
    assert parse_step(str(step)) == step


def test_str_round_trip_long_grace() -> None:
    step = parse_step("signal:SIGUSR1:23h")  # 82800 s
    assert parse_step(str(step)) == step


def test_grace_beyond_a_day_is_refused() -> None:
    with pytest.raises(ValueError, match="grace period must be at most 1d"):
        parse_step("signal:SIGUSR1:12d")


def test_str_round_trip_keeps_precision() -> None:
    step = parse_step("signal:SIGUSR1:1234567ms")
    assert parse_step(str(step)) == step


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("restart", "unknown action 'restart'"),
        ("", "unknown action ''"),
        ("checkpoint-now", "unknown action"),
        ("kill:now", "'kill' takes no arguments"),
        ("freeze:1s", "'freeze' takes no arguments"),
        ("CHECKPOINT:x", "'checkpoint' takes no arguments"),
        ("signal:SIGUSR1", "expected 'signal:SIGNAME:GRACE'"),
        ("signal", "expected 'signal:SIGNAME:GRACE'"),
        ("signal:SIGUSR1:1s:2s", "expected 'signal:SIGNAME:GRACE'"),
        ("signal:NOPE:1s", "unknown signal 'NOPE'"),
        ("signal::1s", "unknown signal ''"),
        ("signal:SIGKILL:1s", "SIGKILL cannot be a cooperative signal"),
        ("signal:kill:1s", "SIGKILL cannot be a cooperative signal"),
        ("signal:SIGSTOP:1s", "SIGSTOP cannot be a cooperative signal"),
        ("signal:stop:1s", "SIGSTOP cannot be a cooperative signal"),
        ("signal:SIGUSR1:0s", "the grace period must be above 0, got '0s'"),
        ("signal:SIGUSR1:0", "the grace period must be above 0"),
        ("signal:SIGUSR1:0ms", "the grace period must be above 0"),
        ("signal:SIGUSR1:soon", "expected a duration"),
        ("signal:SIGUSR1:-1s", "expected a duration"),
    ],
)
def test_parse_step_errors(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_step(text)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value", [None, 3, 1.5, ["checkpoint"], {"kind": "kill"}, b"kill"])
def test_parse_step_rejects_non_strings(value: object) -> None:
    with pytest.raises(ValueError, match="expected an action such as 'checkpoint'"):
        parse_step(value)  # type: ignore[arg-type]


def test_sigkill_refusal_suggests_alternatives() -> None:
    with pytest.raises(ValueError, match="use 'kill' or 'freeze'"):
        parse_step("signal:SIGKILL:1s")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["checkpoint"], (Step(CHECKPOINT),)),
        (["kill"], (Step(KILL),)),
        (["checkpoint", "kill"], (Step(CHECKPOINT), Step(KILL))),
        (["freeze", "checkpoint", "kill"], (Step(FREEZE), Step(CHECKPOINT), Step(KILL))),
        (["freeze", "kill"], (Step(FREEZE), Step(KILL))),
        (["signal:SIGUSR1:30s", "checkpoint"],
         (Step(SIGNAL, signal.SIGUSR1, 30.0), Step(CHECKPOINT))),
        (["signal:SIGUSR1:30s", "signal:SIGTERM:5s", "kill"],
         (Step(SIGNAL, signal.SIGUSR1, 30.0), Step(SIGNAL, signal.SIGTERM, 5.0), Step(KILL))),
        (["freeze", "signal:SIGUSR1:1s", "checkpoint", "kill"],
         (Step(FREEZE), Step(SIGNAL, signal.SIGUSR1, 1.0), Step(CHECKPOINT), Step(KILL))),
    ],
)
def test_parse_chain_valid(value: list[str], expected: tuple[Step, ...]) -> None:
    assert parse_chain(value) == expected


def test_default_chain_parses() -> None:
    assert parse_chain(list(DEFAULT_CHAIN)) == (Step(CHECKPOINT), Step(PAGEOUT))


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ([], "expected a non-empty list of actions"),
        (None, "expected a non-empty list of actions"),
        ("checkpoint", "expected a non-empty list of actions"),
        (("checkpoint",), "expected a non-empty list of actions"),
        ({"checkpoint": 1}, "expected a non-empty list of actions"),
        (["checkpoint", "freeze"], "'freeze' can only be the first action"),
        (["signal:SIGUSR1:1s", "freeze"], "'freeze' can only be the first action"),
        (["kill", "checkpoint"], "'kill' can only be the last action"),
        (["freeze", "kill", "checkpoint"], "'kill' can only be the last action"),
        (["checkpoint", "checkpoint"], "an action other than 'signal' appears twice"),
        (["freeze", "freeze"], "an action other than 'signal' appears twice"),
        (["freeze", "checkpoint", "signal:SIGUSR1:1s", "checkpoint"],
         "an action other than 'signal' appears twice"),
        (["checkpoint", "restart"], "unknown action 'restart'"),
        (["checkpoint", 7], "expected an action such as 'checkpoint'"),
    ],
)
def test_parse_chain_errors(value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_chain(value)
    assert fragment in str(info.value)
