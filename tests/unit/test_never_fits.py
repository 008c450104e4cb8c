"""A checkpoint larger than its cgroup could ever hold (issue 26, item 11): refused with the
figures, as NeverFits, and `restore --wait` does not wait for it (directly, and through the
daemon, which answers it as a failure, not as NoRoom)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.cli.restorewait import restore_when_it_fits
from oomguard.control.server import dispatch
from oomguard.lifecycle.restorefit import RestoreGuard, check_fits
from oomguard.model.errors import NeverFits, NoRoom
from tests.unit.test_restore_guards import Clock, MiB, attempts, fake_cgroup, snap


def test_larger_than_the_threshold_of_the_whole_limit_never_fits() -> None:
    guard = RestoreGuard(Path("/cg/jobs"), 0.85, 64 * MiB)
    with pytest.raises(NeverFits) as never:
        check_fits("job-1", fake_cgroup("/cg/jobs"), snap(0, 256 * MiB), 200 * MiB, guard)
    assert "needs 200 MiB + 64 MiB margin" in str(never.value)
    assert "85% of 256 MiB" in str(never.value) and "--force" in str(never.value)
    # Room taken now, but it would fit in an empty cgroup: NoRoom, worth waiting for.
    with pytest.raises(NoRoom) as later:
        check_fits("job-1", fake_cgroup("/cg/jobs"), snap(100 * MiB, 256 * MiB), 100 * MiB,
                   guard)
    assert not isinstance(later.value, NeverFits)


def test_wait_does_not_wait_for_what_never_fits() -> None:
    clock, told = Clock(), list[str]()
    attempt, calls = attempts(NeverFits("needs 300 MiB, limited to 64 MiB"), {"pid": 7})
    with pytest.raises(NeverFits):
        restore_when_it_fits(attempt, wait=True, timeout=None, tell=told.append, clock=clock,
                             sleep=clock.sleep)
    assert len(calls) == 1 and told == [] and clock.now == 0.0


def test_the_daemon_answers_it_as_a_failure_not_no_room() -> None:
    class Refusing:
        def restore(self, *args: object, **kwargs: object) -> None:
            raise NeverFits("needs 300 MiB, limited to 64 MiB")

    raw = b'{"method":"io.oomguard.Restore","parameters":{"id":"x"}}'
    _method, message = dispatch(Refusing(), raw, 0)  # type: ignore[arg-type]
    assert message["error"] == "io.oomguard.Failed", message
    assert "limited to 64 MiB" in message["parameters"]["message"]
