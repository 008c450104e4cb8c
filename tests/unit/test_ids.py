"""Checkpoint ids as people type them (oomguard.store.ids), and the service resolving them for each
caller over the control socket's dispatch: whole ids, unique prefixes, `last`, ownership."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from oomguard.control.service import Service
from oomguard.model.errors import AmbiguousId, StoreError
from oomguard.store.checkpoints import CheckpointMeta, Store
from oomguard.store.ids import CANDIDATES_SHOWN, resolve_id
from oomguard.terminal.client import HolderError
from oomguard.terminal.commands import attach, names_a_pid
from tests.unit.test_control_dispatch import (
    ALICE,
    BOB,
    NO_CGROUPS,
    NOT_FOUND,
    Forbidden,
    add_checkpoint,
    call,
    err,
    make_meta,
)

AMBIGUOUS = "io.oomguard.AmbiguousId"


def metas(*ids_and_times: tuple[str, float]) -> list[CheckpointMeta]:
    return [make_meta(i, ALICE, created) for i, created in ids_and_times]


SOME = metas(("20250301-100000-42-ab12", 10.0), ("20250301-110000-43-cd34", 30.0),
             ("20250302-090000-44-ef56", 20.0))


@pytest.mark.parametrize(("text", "expected"), [
    ("20250301-100000-42-ab12", "20250301-100000-42-ab12"),  # whole
    ("20250301-11", "20250301-110000-43-cd34"),  # unique prefix
    ("20250302", "20250302-090000-44-ef56"),
    ("last", "20250301-110000-43-cd34"),  # the newest by creation, not by name
])
def test_resolve_names_one(text: str, expected: str) -> None:
    assert resolve_id(text, SOME) == expected


def test_resolve_whole_id_wins_over_a_longer_one_it_begins() -> None:
    both = metas(("20250301-1", 1.0), ("20250301-10", 2.0))
    assert resolve_id("20250301-1", both) == "20250301-1"


def test_a_checkpoint_named_last_is_found_by_its_name() -> None:
    assert resolve_id("last", metas(("last", 1.0), ("later", 2.0))) == "last"


def test_ambiguous_prefix_lists_the_candidates() -> None:
    with pytest.raises(AmbiguousId) as raised:
        resolve_id("20250301", SOME)
    assert raised.value.candidates == ["20250301-100000-42-ab12", "20250301-110000-43-cd34"]
    assert str(raised.value) == ("checkpoint id '20250301' is ambiguous: it begins 2 "
                                 "checkpoints: 20250301-100000-42-ab12, 20250301-110000-43-cd34")


def test_ambiguous_prefix_lists_at_most_a_few() -> None:
    many = metas(*((f"job-{n:02d}", float(n)) for n in range(CANDIDATES_SHOWN + 3)))
    with pytest.raises(AmbiguousId) as raised:
        resolve_id("job-", many)
    assert len(raised.value.candidates) == CANDIDATES_SHOWN + 3
    assert str(raised.value).endswith("job-09 and 3 more")


@pytest.mark.parametrize(("text", "visible", "message"), [
    ("2024", SOME, "no checkpoint '2024' of yours"),
    ("last", [], "no checkpoint of yours yet ('last' names the newest)"),
])
def test_nothing_matches(text: str, visible: list[CheckpointMeta], message: str) -> None:
    with pytest.raises(StoreError, match=r"^no checkpoint") as raised:
        resolve_id(text, visible, whose=" of yours")
    assert str(raised.value) == message
    assert not isinstance(raised.value, AmbiguousId)


# -- through the service, as each caller --------------------------------------------------------

@pytest.fixture
def service(tmp_path: Path) -> Service:
    store = Store(tmp_path / "store")
    for checkpoint_id, uid, created in (("alice-aa", ALICE, 100.0), ("alice-ba", ALICE, 300.0),
                                        ("bob-aa", BOB, 400.0), ("root-aa", 0, 200.0)):
        add_checkpoint(store, checkpoint_id, uid, created, 64)
    return Service(store, restorer=Forbidden("restorer"),  # type: ignore[arg-type]
                   checkpointer=Forbidden("checkpointer"),  # type: ignore[arg-type]
                   layout=NO_CGROUPS)


@pytest.mark.parametrize(("uid", "text", "expected"), [
    (ALICE, "last", "alice-ba"),  # not bob-aa, the newest of all
    (BOB, "last", "bob-aa"),
    (0, "last", "bob-aa"),
    (ALICE, "alice-b", "alice-ba"),
    (ALICE, "alice-ba", "alice-ba"),
    (BOB, "b", "bob-aa"),
    (0, "r", "root-aa"),
])
def test_show_by_prefix_or_last(service: Service, uid: int, text: str, expected: str) -> None:
    shown = call(service, uid, "io.oomguard.Show", id=text)
    assert shown["parameters"]["checkpoint"]["id"] == expected


@pytest.mark.parametrize(("uid", "text", "expected"), [
    (ALICE, "b", (NOT_FOUND, "no checkpoint 'b' of yours")),  # bob's, never matched for alice
    (ALICE, "r", (NOT_FOUND, "no checkpoint 'r' of yours")),
    (1003, "last", (NOT_FOUND, "no checkpoint of yours yet ('last' names the newest)")),
    (ALICE, "alice-", (AMBIGUOUS, "checkpoint id 'alice-' is ambiguous: it begins 2 "
                                   "checkpoints: alice-aa, alice-ba")),
    (0, "al", (AMBIGUOUS, "checkpoint id 'al' is ambiguous: it begins 2 checkpoints: "
                          "alice-aa, alice-ba")),
])
def test_prefix_refused(service: Service, uid: int, text: str,
                        expected: tuple[str, str]) -> None:
    assert err(call(service, uid, "io.oomguard.Show", id=text)) == expected


def test_a_users_prefix_is_not_ambiguous_with_another_users_checkpoints(
        service: Service) -> None:
    """'a' begins alice's two checkpoints only; for bob it begins none of his."""
    assert err(call(service, BOB, "io.oomguard.Show", id="a"))[0] == NOT_FOUND
    assert err(call(service, ALICE, "io.oomguard.Show", id="a"))[0] == AMBIGUOUS


def test_forget_by_prefix_forgets_that_one(service: Service) -> None:
    answer = call(service, ALICE, "io.oomguard.Forget", id="alice-b")
    assert answer == {"parameters": {"id": "alice-ba"}}
    assert [m.id for m in service.store.list()] == ["alice-aa", "root-aa", "bob-aa"]
    assert call(service, ALICE, "io.oomguard.Show", id="last")["parameters"]["checkpoint"][
        "id"] == "alice-aa"


@pytest.mark.parametrize(("target", "pid"), [
    ("4242", True), ("4194304", True), ("20250301", False), ("2025030", True),
    ("20250301-1", False), ("last", False)])
def test_attach_tells_a_pid_from_an_id_prefix(target: str, pid: bool) -> None:
    assert names_a_pid(target) is pid


def test_attach_by_id_prefix_asks_the_service_to_resolve_it() -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def call(method: str, **parameters: Any) -> dict[str, Any]:
        asked.append((method, parameters))
        return {"checkpoint": {"id": "20250301-120000-42-ab12", "extra": {}}}

    with pytest.raises(HolderError, match=r"^checkpoint 20250301-120000-42-ab12 had no terminal$"):
        attach("20250301", call)
    assert asked == [("Show", {"id": "20250301"})]
