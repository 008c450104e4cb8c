"""acting.Workers: action threads kept between actions, one per action in flight."""

from __future__ import annotations

import threading

from oomguard.respond.actor import Workers


def _thread_of(workers: Workers) -> tuple[threading.Event, list[int]]:
    seen: list[int] = []
    done = workers.run(lambda: seen.append(threading.get_ident()))
    assert done.wait(5)
    return done, seen


def test_an_idle_thread_takes_the_next_action() -> None:
    workers = Workers(keep=2)
    _, first = _thread_of(workers)
    idents = set(first)
    for _ in range(20):
        _, seen = _thread_of(workers)
        idents.update(seen)
    assert len(idents) == 1  # one thread served every action, one after another


def test_actions_in_flight_each_get_a_thread_and_only_keep_stay() -> None:
    workers = Workers(keep=1)
    release = threading.Event()
    started = threading.Barrier(4, timeout=5)  # the three actions and this test
    seen: list[int] = []
    lock = threading.Lock()

    def blocking() -> None:
        with lock:
            seen.append(threading.get_ident())
        started.wait()  # all three run at once: none waits for another's thread
        release.wait(5)

    dones = [workers.run(blocking) for _ in range(3)]
    started.wait()
    assert len(set(seen)) == 3
    release.set()
    assert all(done.wait(5) for done in dones)
    before = threading.active_count()
    for _ in range(3):
        _thread_of(workers)
    assert threading.active_count() <= before  # the extra threads ended; one is kept


def test_a_failing_action_still_reports_its_end() -> None:
    workers = Workers(keep=1)
    failures: list[BaseException | None] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(args.exc_value)
    try:
        def boom() -> None:
            raise RuntimeError("a bug in an action")
        assert workers.run(boom).wait(5)
        _, seen = _thread_of(workers)  # the next action still runs
        assert seen
    finally:
        threading.excepthook = old_hook
    assert [str(f) for f in failures] == ["a bug in an action"]


def test_the_one_gate_every_trigger_asks() -> None:
    """Actor.may_act: not while the name's action runs, nor within its post-action delay."""
    import threading
    from typing import Any

    from oomguard.respond.actor import Actor

    release = threading.Event()

    class Runner:
        checkpointer: Any = None

    actor = Actor(Runner(), None, dry_run=False, clock=lambda: 100.0)  # type: ignore[arg-type]
    assert actor.may_act("/jobs", 5.0, 100.0)  # never acted
    actor._running["/jobs"] = release  # an action in flight
    assert not actor.may_act("/jobs", 0.0, 1e9)
    release.set()
    actor.last_done["/jobs"] = 100.0
    assert not actor.may_act("/jobs", 5.0, 104.9)
    assert actor.may_act("/jobs", 5.0, 105.0)
    assert actor.may_act("/other", 5.0, 100.0)  # per name
