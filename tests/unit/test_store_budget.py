"""The store's budget: its figures (oomguard.policy.budget, pure) and the pruning that makes
room, on a real store directory (oomguard.store.budget): restored checkpoints only, oldest
first; a checkpoint that has not been restored is never deleted, and a reservation that does
not fit is refused with the figures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.policy.budget import IMAGE_OVERHEAD, BudgetReading, image_estimate, resolve
from oomguard.store.budget import BudgetExceeded, StoreBudget, disk_used
from oomguard.store.checkpoints import Store
from tests.unit.test_store import make_meta

MiB = 1 << 20


def test_limits_resolve_as_a_size_or_a_share_of_the_file_system() -> None:
    assert resolve(None, 1000) is None
    assert resolve(0.1, 1000 * MiB) == 100 * MiB
    assert resolve(5 * MiB, 1000 * MiB) == 5 * MiB


@pytest.mark.parametrize(
    ("reading", "need", "excess"),
    [
        (BudgetReading(used=10, cap=100, free=1000, keep_free=100, total=2000), 50, 0),
        (BudgetReading(used=10, cap=100, free=1000, keep_free=100, total=2000), 95, 5),  # cap
        (BudgetReading(used=10, cap=None, free=300, keep_free=100, total=2000), 250, 50),  # free
        (BudgetReading(used=10, cap=100, free=120, keep_free=100, total=2000), 90, 70),  # worst
        (BudgetReading(used=500, cap=100, free=1000, keep_free=0, total=2000), 0, 400),  # over
    ],
)
def test_excess_is_what_must_be_freed_for_the_need_to_fit(reading: BudgetReading, need: int,
                                                          excess: int) -> None:
    assert reading.excess(need) == excess
    assert reading.fits(need) is (excess == 0)


def test_the_refusal_names_every_figure() -> None:
    reading = BudgetReading(used=30 * MiB, cap=32 * MiB, free=40 * MiB, keep_free=9 * MiB,
                            total=64 * MiB)
    text = reading.refusal(8 * MiB)
    for figure in ("~8.0MiB", "30.0MiB used", "32.0MiB cap", "40.0MiB free", "9.0MiB free"):
        assert figure in text, text


def checkpoint(store: Store, ident: str, created: float, *, restored: bool,
               size: int = MiB) -> None:
    meta = make_meta(ident, created=created)
    images, fd = store.begin(meta)
    os.close(fd)
    with open(images / "pages-1.img", "wb") as pages:
        pages.write(os.urandom(size))  # blocks on disk, not a hole
    store.commit(meta)
    if restored:
        meta = store.get(ident)
        meta.state, meta.restored_at = "restored", created + 1
        store.update(meta)


def test_make_room_prunes_restored_oldest_first_and_never_an_unrestored_one(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    checkpoint(store, "r-old", 100.0, restored=True)
    checkpoint(store, "c-oldest", 50.0, restored=False)
    checkpoint(store, "r-new", 200.0, restored=True)
    checkpoint(store, "c-new", 300.0, restored=False)
    used = disk_used(store.root)
    assert used >= 4 * MiB
    budget = StoreBudget(store, used + MiB // 2, None, wall_clock=lambda: 400.0)
    reading, pruned = budget.make_room(MiB)  # one more MiB: one restored checkpoint goes
    assert [p.id for p in pruned] == ["r-old"]
    assert reading.fits(MiB) and reading.used == disk_used(store.root)
    reading, pruned = budget.make_room(4 * MiB)  # far beyond: every restored one, no more
    assert [p.id for p in pruned] == ["r-new"]
    assert not reading.fits(4 * MiB)
    assert sorted(m.id for m in store.list()) == ["c-new", "c-oldest"]
    with pytest.raises(BudgetExceeded) as refused, budget.reserve(4 * MiB):
        pass
    assert refused.value.figures["need"] == 4 * MiB
    assert refused.value.figures["cap"] == used + MiB // 2
    assert sorted(m.id for m in store.list()) == ["c-new", "c-oldest"]


def test_a_reservation_counts_against_the_next_until_its_dump_ends(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.ensure()
    budget = StoreBudget(store, disk_used(store.root) + 3 * MiB, None)
    with budget.reserve(2 * MiB):
        with pytest.raises(BudgetExceeded) as refused, budget.reserve(2 * MiB):
            pass
        assert refused.value.figures["pending"] == 2 * MiB
    with budget.reserve(2 * MiB):  # the first one's dump ended: room again
        pass


def test_a_reservation_grows_only_where_the_budget_has_room(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.ensure()
    budget = StoreBudget(store, disk_used(store.root) + 5 * MiB, None)
    with budget.reserve(2 * MiB) as first, budget.reserve(1 * MiB) as second:
        first.grow(MiB)  # smaller: it stays as it was
        assert first.need == 2 * MiB
        first.grow(4 * MiB)  # 4 + 1 of 5: room
        assert first.need == 4 * MiB
        with pytest.raises(BudgetExceeded) as refused:
            second.grow(2 * MiB)  # 4 + 2 > 5: refused, and it keeps what it had
        assert refused.value.figures["pending"] == 4 * MiB
        assert second.need == MiB
        with pytest.raises(BudgetExceeded), budget.reserve(1 * MiB):
            pass  # 4 + 1 + 1 > 5: the grown reservation counts
    with budget.reserve(5 * MiB):  # both ended: all of it again
        pass


def test_doctor_shows_the_store_against_its_budget(tmp_path: Path) -> None:
    from oomguard.cli.doctorconfig import budget_check
    from oomguard.config.loading import load_config_text

    root = tmp_path / "store"
    config = load_config_text(f'[daemon]\nstore = "{root}"\nstore_max_size = "1M"\n'
                              'store_keep_free = "1%"\n', "x.toml")
    check = budget_check(config)
    assert check.ok and check.line().startswith("PASS  store budget: 0B used of 1.0MiB "
                                                "(store_max_size)"), check.line()
    assert "(store_keep_free)" in check.line()
    root.mkdir()
    (root / "old").write_bytes(os.urandom(2 * MiB))
    over = budget_check(config)
    assert not over.ok and over.line().startswith("WARN  store budget: "), over.line()
    assert "OVER BUDGET" in over.line() and "restore or `oomguard forget`" in over.line()
    none = budget_check(load_config_text(f'[daemon]\nstore = "{root}"\nstore_max_size = "0"\n'
                                         'store_keep_free = "0"\n', "x.toml"))
    assert none.line().startswith("WARN  store budget: none: ") and "can fill the disk" in \
        none.line()


def test_the_usage_cache_walks_a_committed_checkpoint_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between a crossing and the SIGSTOP the store is not walked again: a checkpoint's size is
    kept while its directory stays as it was; a new, removed or changed one is seen."""
    from oomguard.store import budget as budget_module

    store = Store(tmp_path / "store")
    checkpoint(store, "a", 100.0, restored=False)
    checkpoint(store, "b", 200.0, restored=False)
    cache = budget_module.UsageCache()
    first = cache.used(store.root)
    assert first == disk_used(store.root)
    walked: list[Path] = []
    real = budget_module.disk_used

    def counting(path: Path) -> int:
        walked.append(path)
        return real(path)

    monkeypatch.setattr(budget_module, "disk_used", counting)
    assert cache.used(store.root) == first and walked == []
    checkpoint(store, "c", 300.0, restored=True)  # restored: its meta.json written anew
    grown = cache.used(store.root)
    assert grown > first + MiB and [p.name for p in walked] == ["c"]
    store.forget("a")
    assert cache.used(store.root) < grown - MiB


def test_a_checkpoints_estimate_covers_its_growth_metadata_and_logs() -> None:
    """The reservation is an over-estimate: a 100 MiB tree in a cgroup with 40 MiB left under
    its limit may be 140 MiB when stopped, plus its page maps and CRIU's logs (the soak's store
    went 6 MiB over its cap when only the resident memory was reserved)."""
    assert image_estimate(100 * MiB, 40 * MiB) == 140 * MiB + 100 * MiB // 32 + IMAGE_OVERHEAD
    assert image_estimate(100 * MiB) == 100 * MiB + 100 * MiB // 32 + IMAGE_OVERHEAD
    assert image_estimate(0, -5) == IMAGE_OVERHEAD  # usage above a limit: no negative growth


def test_a_deferred_reservation_prunes_only_once_asked_and_never_twice(
        tmp_path: Path) -> None:
    """The prunes a dump's reservation needs are chosen before its tree is stopped and made
    after (removing checkpoints took 250-400 ms on the way from a crossing to SIGSTOP): none
    is deleted before, another reservation meanwhile counts them as made and never chooses
    them, and one that ends without asking deletes nothing."""
    store = Store(tmp_path / "store")
    checkpoint(store, "r-old", 100.0, restored=True)
    checkpoint(store, "r-new", 200.0, restored=True)
    checkpoint(store, "c-kept", 300.0, restored=False)
    sizes = {m.id: m.image_bytes for m in store.list()}
    assert all(size >= MiB for size in sizes.values()), sizes  # what the plan counts on
    used = disk_used(store.root)
    told: list[list[str]] = []
    budget = StoreBudget(store, used + MiB // 2, None, wall_clock=lambda: 400.0)
    with budget.reserve(MiB, lambda pruned: told.append([p.id for p in pruned]),
                        deferred=True) as first:
        assert [p.id for p in first.planned] == ["r-old"]
        assert len(store.list()) == 3 and told == []  # chosen, not deleted
        with budget.reserve(MiB, deferred=True) as second:
            assert [p.id for p in second.planned] == ["r-new"]  # not r-old again
        # The second ended without pruning: r-new stays, and is free to be chosen again.
        assert sorted(m.id for m in store.list()) == ["c-kept", "r-new", "r-old"]
        first.prune_planned()
        assert told == [["r-old"]] and first.planned == []
        assert sorted(m.id for m in store.list()) == ["c-kept", "r-new"]
        first.prune_planned()  # once
        assert told == [["r-old"]]
    with pytest.raises(BudgetExceeded), budget.reserve(8 * MiB, deferred=True):
        pass  # beyond every restored checkpoint: refused at once, nothing deleted
    assert sorted(m.id for m in store.list()) == ["c-kept", "r-new"]


def test_a_planned_prune_that_cannot_be_made_is_made_up_for_or_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planned prune whose checkpoint is being restored when the time comes (its forget
    refused): the reservation is claimed again as it stands, and refused where nothing else
    makes room; an unrestored checkpoint is never the one that goes."""
    store = Store(tmp_path / "store")
    checkpoint(store, "r-busy", 100.0, restored=True)
    checkpoint(store, "c-kept", 300.0, restored=False)
    budget = StoreBudget(store, disk_used(store.root) + MiB // 2, None, wall_clock=lambda: 400.0)
    monkeypatch.setattr(budget, "_forget", lambda ident: False)  # being restored right now
    with budget.reserve(MiB, deferred=True) as room:
        assert [p.id for p in room.planned] == ["r-busy"]
        with pytest.raises(BudgetExceeded):
            room.prune_planned()
    assert sorted(m.id for m in store.list()) == ["c-kept", "r-busy"]
    assert budget._doomed == {} and budget._reserved == {}
