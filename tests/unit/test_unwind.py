"""The undo runner the checkpoint walks (oomguard.model.unwind)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from oomguard.model.unwind import Undos, on_failure, unwinding


def recorder(log: list[str], name: str) -> Callable[[BaseException | None], None]:
    def undo(failure: BaseException | None) -> None:
        log.append(f"{name}:{type(failure).__name__ if failure else 'ok'}")
    return undo


def test_a_run_that_goes_through_is_undone_latest_first_each_told_it_went_through() -> None:
    log: list[str] = []
    with unwinding() as undos:
        for name in ("a", "b", "c"):
            undos.did(name, recorder(log, name))
    assert log == ["c:ok", "b:ok", "a:ok"]


def test_a_failure_undoes_what_was_done_and_only_that_and_goes_on_as_it_was() -> None:
    log: list[str] = []
    with pytest.raises(KeyError), unwinding() as undos:
        undos.did("a", recorder(log, "a"))
        undos.did("b", recorder(log, "b"))
        raise KeyError("c failed")
    assert log == ["b:KeyError", "a:KeyError"]


def test_first_goes_before_every_other_whenever_it_was_done() -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError), unwinding() as undos:
        undos.did("limit", recorder(log, "limit"), first=True)
        undos.did("freeze", recorder(log, "freeze"))
        undos.did("others", recorder(log, "others"))
        raise RuntimeError
    assert log == ["limit:RuntimeError", "others:RuntimeError", "freeze:RuntimeError"]


def test_done_again_takes_the_later_place_and_only_the_last_undo_runs() -> None:
    log: list[str] = []
    with unwinding() as undos:
        undos.did("lift", recorder(log, "lift-1"))
        undos.did("freeze", recorder(log, "freeze"))
        undos.did("lift", recorder(log, "lift-2"))
    assert log == ["lift-2:ok", "freeze:ok"]


def test_now_undoes_one_at_once_as_after_success_and_never_again() -> None:
    log: list[str] = []
    with pytest.raises(ValueError), unwinding() as undos:
        undos.did("a", recorder(log, "a"))
        undos.did("b", recorder(log, "b"))
        undos.now("a")
        undos.now("missing")  # nothing done by that name: nothing to undo
        assert log == ["a:ok"] and not undos.done("a") and undos.done("b")
        raise ValueError
    assert log == ["a:ok", "b:ValueError"]


def test_an_undo_that_raises_keeps_none_of_the_others_from_running() -> None:
    log: list[str] = []

    def broken(failure: BaseException | None) -> None:
        raise OSError("undo broke")

    with pytest.raises(OSError, match="undo broke") as raised, unwinding() as undos:
        undos.did("a", recorder(log, "a"))
        undos.did("broken", broken)
        undos.did("c", recorder(log, "c"))
        raise KeyError("the failure")
    assert log == ["c:KeyError", "a:KeyError"]
    assert isinstance(raised.value.__context__, KeyError)  # the failure is not lost


def test_a_context_manager_entered_as_a_step_is_left_with_the_failure() -> None:
    seen: list[object] = []

    @contextlib.contextmanager
    def held() -> Iterator[int]:
        try:
            yield 7
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise
        seen.append("left")

    with unwinding() as undos:
        assert undos.enter("held", held()) == 7
    with pytest.raises(LookupError), unwinding() as undos:
        undos.enter("held", held())
        raise LookupError
    assert seen == ["left", "LookupError"]


def test_undos_outside_a_with_are_unwound_when_asked_once() -> None:
    log: list[str] = []
    undos = Undos()
    undos.did("a", recorder(log, "a"))
    undos.unwind(None)
    undos.unwind(None)
    assert log == ["a:ok"]


def test_on_failure_runs_only_after_a_failure() -> None:
    ran: list[str] = []
    with unwinding() as undos:
        undos.did("lease", on_failure(lambda: ran.append("given back")))
    assert ran == []
    with pytest.raises(OSError), unwinding() as undos:
        undos.did("lease", on_failure(lambda: ran.append("given back")))
        raise OSError("the hook cannot be read")
    assert ran == ["given back"]
