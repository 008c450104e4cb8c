"""A run of steps, each undone once, latest first, however the run ends (Undos, unwinding).

A step that has done something says so with its undo (`did`); the undo is told how the run
ended (None: it went through; else the exception that ended it), so it undoes all of what
its step did on a failure and only what is left to undo after a success. An undo marked
`first` goes before every other (as a limit lifted for a dump: put back before anything
held for it goes on). A thing that is over before the run ends is undone then (`now`). An
undo that raises does not keep the others from running: the first such error is raised once
all have run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

Undo = Callable[[BaseException | None], object]  # told the failure that ended the run, or None
T = TypeVar("T")


@dataclass
class _Done:
    name: str
    undo: Undo
    first: bool


class Undos:
    """What a run has done so far, each with its undo, in the order done."""

    def __init__(self) -> None:
        self._done: list[_Done] = []

    def did(self, name: str, undo: Undo, *, first: bool = False) -> None:
        """`name` is done, undone by `undo`. Done again (a later step adds to it), its undo
        is replaced and takes the later place."""
        self._done = [d for d in self._done if d.name != name]
        self._done.append(_Done(name, undo, first))

    def enter(self, name: str, context: AbstractContextManager[T]) -> T:
        """A context manager entered as a step, left as its undo (told the failure)."""
        value = context.__enter__()

        def leave(failure: BaseException | None) -> None:
            if failure is None:
                context.__exit__(None, None, None)
            else:
                context.__exit__(type(failure), failure, failure.__traceback__)
        self.did(name, leave)
        return value

    def now(self, name: str) -> None:
        """What `name` did is over while the run goes on: undone now, as after a success."""
        for done in self._done:
            if done.name == name:
                self._done.remove(done)
                done.undo(None)
                return

    def done(self, name: str) -> bool:
        return any(d.name == name for d in self._done)

    def unwind(self, failure: BaseException | None) -> None:
        """Every undo left, once: those marked first, then the rest, each latest first."""
        order = [d for d in self._done if d.first][::-1] + \
            [d for d in self._done if not d.first][::-1]
        self._done = []
        error: BaseException | None = None
        for done in order:
            try:
                done.undo(failure)
            except Exception as exc:  # the rest are undone all the same
                if error is None:
                    error = exc
        if error is not None:
            if failure is not None:
                error.__context__ = failure
            raise error


def on_failure(action: Callable[[], object]) -> Undo:
    """An undo that runs `action` only where the run failed (nothing is left to undo after a
    success)."""
    def undo(failure: BaseException | None) -> None:
        if failure is not None:
            action()
    return undo


@contextlib.contextmanager
def unwinding() -> Iterator[Undos]:
    """Undos for the steps run inside it, unwound as it is left, however it is left."""
    undos = Undos()
    try:
        yield undos
    except BaseException as failure:
        undos.unwind(failure)
        raise
    undos.unwind(None)
