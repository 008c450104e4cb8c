"""oomguard.policy.retention.choose_prunes: which checkpoints the store deletes, in which order,
and why. Only restored ones, ever: one not restored yet is all there is of its process."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from oomguard.policy.retention import Prune, Stored, choose_prunes

NOW = 10_000.0

AGED = "restored and older than max_age"
R_BUDGET = "restored; the store is over its budget"


def item(ident: str, age: float, state: str = "checkpointed", size: int = 100) -> Stored:
    """A stored checkpoint created `age` seconds before NOW."""
    return Stored(id=ident, created=NOW - age, state=state, size=size)


@dataclass(frozen=True)
class Case:
    name: str
    items: list[Stored]
    excess: int  # bytes the budget wants freed
    max_age: float | None
    want: list[tuple[str, str]]  # (id, reason), in order


CASES = [
    Case("empty-store", [], 100, 60, []),
    Case("within-budget-no-age", [item("r", 9000, "restored"), item("c", 9000)], 0, None, []),
    Case("only-restored-and-expired",
         [item("r-old", 200, "restored"), item("r-new", 50, "restored"), item("c-old", 500),
          item("c-new", 10)],
         0, 100, [("r-old", AGED)]),
    Case("age-exactly-max-age-is-not-expired",
         [item("r-edge", 100, "restored"), item("r-over", 100.5, "restored")],
         0, 100, [("r-over", AGED)]),
    Case("restored-first-oldest-first",
         [item("c-oldest", 900), item("r-young", 300, "restored"), item("r-old", 400, "restored")],
         150, None, [("r-old", R_BUDGET), ("r-young", R_BUDGET)]),
    Case("stops-as-soon-as-the-excess-is-freed",
         [item("r1", 400, "restored"), item("r2", 300, "restored"), item("c", 500)],
         100, None, [("r1", R_BUDGET)]),
    Case("aged-prunes-count-toward-the-excess",
         [item("r-exp", 500, "restored", 500), item("r", 100, "restored"), item("c", 600)],
         200, 300, [("r-exp", AGED)]),
    Case("aged-then-oldest-restored",
         [item("r-exp", 500, "restored"), item("r-ok", 100, "restored"), item("c", 50)],
         150, 300, [("r-exp", AGED), ("r-ok", R_BUDGET)]),
    Case("unrestored-never-even-when-expired-and-over-budget",
         [item("c1", 900), item("c2", 600), item("c3", 100)], 10_000, 500, []),
    Case("oldest-first-not-largest-first",
         [item("r-old", 30, "restored", 10), item("r-big", 20, "restored", 1000), item("c", 40)],
         5, None, [("r-old", R_BUDGET)]),
    Case("excess-beyond-reach-takes-every-restored-and-no-more",
         [item("c-a", 50), item("r-b", 40, "restored"), item("c-c", 900),
          item("r-d", 30, "restored"), item("x", 5, "incomplete")],
         1 << 40, 600, [("r-b", R_BUDGET), ("r-d", R_BUDGET)]),
    Case("dumping-never-chosen", [item("d", 9000, "dumping", 10_000), item("c", 10)], 1 << 40, 1,
         []),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_choose_prunes(case: Case) -> None:
    sizes = {i.id: i.size for i in case.items}
    got = choose_prunes(case.items, NOW, case.excess, case.max_age)
    assert [(p.id, p.reason) for p in got] == case.want
    assert all(p.size == sizes[p.id] for p in got)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_input_order_does_not_matter(case: Case) -> None:
    expected = choose_prunes(case.items, NOW, case.excess, case.max_age)
    shuffled = list(case.items)
    random.Random(case.name).shuffle(shuffled)
    assert choose_prunes(reversed(case.items), NOW, case.excess, case.max_age) == expected
    assert choose_prunes(iter(shuffled), NOW, case.excess, case.max_age) == expected


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_invariants(case: Case) -> None:
    got = choose_prunes(case.items, NOW, case.excess, case.max_age)
    by_id = {i.id: i for i in case.items}
    ids = [p.id for p in got]
    assert len(ids) == len(set(ids)), "an item chosen twice"
    assert all(by_id[i].state == "restored" for i in ids), "only restored ones, ever"
    budget_prunes = [p for p in got if p.reason != AGED]
    freed = sum(p.size for p in got)
    if budget_prunes:  # minimal: without the last one the excess would not be freed
        assert freed - budget_prunes[-1].size < case.excess
    if freed < case.excess:  # short of the excess: every restored one was taken
        assert set(ids) == {i.id for i in case.items if i.state == "restored"}


def test_returns_prune_records() -> None:
    got = choose_prunes([item("r", 100, "restored", 7)], NOW, 0, 50)
    assert got == [Prune("r", 7, AGED)]


def test_max_age_zero_expires_anything_older_than_now() -> None:
    items = [item("r-now", 0, "restored"), item("r-past", 0.001, "restored")]
    assert [p.id for p in choose_prunes(items, NOW, 0, 0)] == ["r-past"]
