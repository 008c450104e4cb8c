"""oomguard.policy.retention.choose_prunes: which checkpoints the store deletes, in which order, and why."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from oomguard.policy.retention import Prune, Stored, choose_prunes

NOW = 10_000.0

AGED = "restored and older than max_age"
R_BUDGET = "restored; store over its size budget"
E_BUDGET = "older than max_age; store over its size budget"
U_BUDGET = "oldest unrestored checkpoint; the store's size budget demands it"


def item(ident: str, age: float, state: str = "checkpointed", size: int = 100) -> Stored:
    """A stored checkpoint created `age` seconds before NOW."""
    return Stored(id=ident, created=NOW - age, state=state, size=size)


@dataclass(frozen=True)
class Case:
    name: str
    items: list[Stored]
    max_bytes: int | None
    max_age: float | None
    want: list[tuple[str, str]]  # (id, reason), in order


CASES = [
    Case("empty-store", [], 100, 60, []),
    Case("no-budget-no-age", [item("r", 9000, "restored"), item("c", 9000)], None, None, []),
    Case("no-budget-only-restored-and-expired",
         [item("r-old", 200, "restored"), item("r-new", 50, "restored"), item("c-old", 500),
          item("c-new", 10)],
         None, 100, [("r-old", AGED)]),
    Case("age-exactly-max-age-is-not-expired",
         [item("r-edge", 100, "restored"), item("r-over", 100.5, "restored")],
         None, 100, [("r-over", AGED)]),
    Case("restored-expired-go-even-under-budget",
         [item("r-old", 500, "restored", 10), item("c", 600, size=10)],
         1_000_000, 100, [("r-old", AGED)]),
    Case("under-budget-nothing",
         [item("r", 10, "restored"), item("c1", 30), item("c2", 20)], 300, None, []),
    Case("exactly-at-budget-nothing",
         [item("r", 10, "restored"), item("c1", 30)], 200, None, []),
    Case("restored-first-oldest-first",
         [item("c-oldest", 900), item("r-young", 300, "restored"), item("r-old", 400, "restored")],
         150, None, [("r-old", R_BUDGET), ("r-young", R_BUDGET)]),
    Case("stops-as-soon-as-within-budget",
         [item("r1", 400, "restored"), item("r2", 300, "restored"), item("c", 500)],
         200, None, [("r1", R_BUDGET)]),
    Case("aged-restored-prune-counts-toward-budget",
         [item("r-exp", 500, "restored", 500), item("c", 600, size=100)],
         200, 300, [("r-exp", AGED)]),
    Case("aged-prune-then-budget-restored",
         [item("r-exp", 500, "restored"), item("r-ok", 100, "restored"), item("c", 50)],
         100, 300, [("r-exp", AGED), ("r-ok", R_BUDGET)]),
    Case("expired-unrestored-after-restored",
         [item("c-exp", 900), item("r", 10, "restored"), item("c-new", 20)],
         150, 500, [("r", R_BUDGET), ("c-exp", E_BUDGET)]),
    Case("then-oldest-unrestored-only-if-still-over",
         [item("c1", 900), item("c2", 600), item("c3", 100), item("c4", 50)],
         200, 500, [("c1", E_BUDGET), ("c2", E_BUDGET)]),
    Case("oldest-unrestored-when-budget-demands",
         [item("c1", 900), item("c2", 600), item("c3", 100), item("c4", 50)],
         50, 500, [("c1", E_BUDGET), ("c2", E_BUDGET), ("c3", U_BUDGET), ("c4", U_BUDGET)]),
    Case("no-age-oldest-unrestored-first",
         [item("c-new", 10), item("c-mid", 20), item("c-old", 30)],
         150, None, [("c-old", U_BUDGET), ("c-mid", U_BUDGET)]),
    Case("oldest-first-not-largest-first",
         [item("c-old", 30, size=10), item("r", 20, "restored", 10), item("c-big", 25, size=1000)],
         20, None, [("r", R_BUDGET), ("c-old", U_BUDGET), ("c-big", U_BUDGET)]),
    Case("zero-budget-prunes-everything-in-tier-order",
         [item("c-a", 50), item("r-b", 40, "restored"), item("c-c", 900), item("r-d", 30, "restored"),
          item("c-e", 5)],
         0, 600, [("r-b", R_BUDGET), ("r-d", R_BUDGET), ("c-c", E_BUDGET), ("c-a", U_BUDGET),
                  ("c-e", U_BUDGET)]),
    Case("dumping-not-counted",
         [item("d", 9000, "dumping", 10_000), item("c", 10)], 100, None, []),
    Case("dumping-never-chosen-even-at-zero-budget",
         [item("d", 9000, "dumping", 10_000), item("c", 10), item("r", 5, "restored")], 0, 1,
         [("r", AGED), ("c", E_BUDGET)]),
    Case("dumping-never-chosen-when-expired-and-no-budget",
         [item("d", 9000, "dumping")], None, 1, []),
    Case("budget-unreachable-takes-all-non-dumping",
         [item("d", 1, "dumping", 50), item("c", 2, size=500), item("r", 3, "restored", 500)],
         10, None, [("r", R_BUDGET), ("c", U_BUDGET)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_choose_prunes(case: Case) -> None:
    sizes = {i.id: i.size for i in case.items}
    got = choose_prunes(case.items, NOW, case.max_bytes, case.max_age)
    assert [(p.id, p.reason) for p in got] == case.want
    assert all(p.size == sizes[p.id] for p in got)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_input_order_does_not_matter(case: Case) -> None:
    expected = choose_prunes(case.items, NOW, case.max_bytes, case.max_age)
    shuffled = list(case.items)
    random.Random(case.name).shuffle(shuffled)
    assert choose_prunes(reversed(case.items), NOW, case.max_bytes, case.max_age) == expected
    assert choose_prunes(iter(shuffled), NOW, case.max_bytes, case.max_age) == expected


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_invariants(case: Case) -> None:
    got = choose_prunes(case.items, NOW, case.max_bytes, case.max_age)
    by_id = {i.id: i for i in case.items}
    ids = [p.id for p in got]
    assert len(ids) == len(set(ids)), "an item chosen twice"
    assert all(by_id[i].state != "dumping" for i in ids)
    counted = [i for i in case.items if i.state != "dumping"]
    remaining = sum(i.size for i in counted) - sum(p.size for p in got)
    budget_prunes = [p for p in got if p.reason != AGED]
    if case.max_bytes is None:
        assert budget_prunes == []
    elif budget_prunes:
        # Minimal: without the last budget prune the store would still be over budget.
        assert remaining + budget_prunes[-1].size > case.max_bytes
    if case.max_bytes is not None and remaining > case.max_bytes:
        assert len(got) == len(counted), "over budget although candidates were left"


def test_returns_prune_records() -> None:
    got = choose_prunes([item("r", 100, "restored", 7)], NOW, None, 50)
    assert got == [Prune("r", 7, AGED)]


def test_max_age_zero_expires_anything_older_than_now() -> None:
    items = [item("r-now", 0, "restored"), item("r-past", 0.001, "restored")]
    assert [p.id for p in choose_prunes(items, NOW, None, 0)] == ["r-past"]
