"""Store entries a user or a failing disk mangled — symlinks, malformed meta.json (wrong types,
null, huge values, deep nesting) — are skipped with a reason, never followed, never deleted,
and everything else keeps working."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from oomguard.model.errors import StoreError
from oomguard.store.checkpoints import META, CheckpointMeta, Store
from tests.unit.test_store import checkpoint, make_meta

GOOD = "20250101-120000-4242-abcd"


def good_store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "store")
    checkpoint(store, make_meta(GOOD))
    return store


def write_entry(store: Store, name: str, data: object) -> Path:
    entry = store.root / name
    entry.mkdir(mode=0o700)
    (entry / META).write_text(data if isinstance(data, str) else json.dumps(data))
    return entry


def meta_with(name: str, **changes: object) -> dict[str, object]:
    data = asdict(make_meta(name))
    data.update(changes)
    return data


MALFORMED = {
    "pid-string": meta_with("pid-string", pid="4242"),
    "pid-null": meta_with("pid-null", pid=None),
    "pid-huge": meta_with("pid-huge", pid=10**30),
    "pids-not-list": meta_with("pids-not-list", pids={"a": 1}),
    "stopped-nspid-zero": meta_with("stopped-nspid-zero", stopped_nspids=[0]),
    "created-null": meta_with("created-null", created=None),
    "created-inf": '{"created": 1e999}',
    "rss-bool": meta_with("rss-bool", rss_bytes=True),
    "command-list": meta_with("command-list", command=["a"]),
    "restored-at-str": meta_with("restored-at-str", restored_at="yesterday"),
    "extra-list": meta_with("extra-list", extra=[1, 2]),
    "no-pid": {k: v for k, v in meta_with("no-pid").items() if k != "pid"},
    "not-object": [1, 2, 3],
    "not-json": "{not json",
    "deep": "[" * 100_000 + "]" * 100_000,
    "wrong-id": meta_with("some-other-id"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_meta_is_skipped_with_a_reason(tmp_path: Path, name: str) -> None:
    store = good_store(tmp_path)
    entry = write_entry(store, name, MALFORMED[name])
    scan = store.scan()
    assert [m.id for m in scan.checkpoints] == [GOOD]
    assert [n for n, _ in scan.skipped] == [name]
    assert scan.skipped[0][1]
    with pytest.raises(StoreError):
        store.get(name)
    with pytest.raises(StoreError):
        store.forget(name)
    assert entry.is_dir(), "a malformed entry is never deleted"
    assert store.get(GOOD).id == GOOD


def test_symlinked_entry_is_never_followed_nor_deleted(tmp_path: Path) -> None:
    store = good_store(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / META).write_text(json.dumps(meta_with("evil")))
    (elsewhere / "precious").write_text("keep me")
    (store.root / "evil").symlink_to(elsewhere)
    scan = store.scan()
    assert [m.id for m in scan.checkpoints] == [GOOD]
    assert scan.skipped == [("evil", "store entry 'evil' is a symlink (not followed)")]
    with pytest.raises(StoreError, match="symlink"):
        store.get("evil")
    with pytest.raises(StoreError, match="symlink"):
        store.forget("evil")
    assert (elsewhere / "precious").read_text() == "keep me"


def test_symlinked_meta_json_is_not_followed(tmp_path: Path) -> None:
    store = good_store(tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(meta_with("linked")))
    entry = store.root / "linked"
    entry.mkdir()
    (entry / META).symlink_to(secret)
    scan = store.scan()
    assert [n for n, _ in scan.skipped] == ["linked"]
    assert "symlink is never followed" in scan.skipped[0][1]
    with pytest.raises(StoreError):
        store.forget("linked")
    assert secret.exists() and entry.is_dir()


def test_a_plain_file_and_an_empty_directory_are_skipped(tmp_path: Path) -> None:
    store = good_store(tmp_path)
    (store.root / "stray-file").write_text("x")
    (store.root / "empty-dir").mkdir()
    scan = store.scan()
    assert [m.id for m in scan.checkpoints] == [GOOD]
    assert sorted(n for n, _ in scan.skipped) == ["empty-dir", "stray-file"]


def test_meta_round_trip_still_accepts_what_oomguard_writes(tmp_path: Path) -> None:
    meta = make_meta(GOOD, restored_at=1_700_000_100.5, restored_pid=99, gpu_pids=[7],
                     stopped_nspids=[3, 5],
                     extra={"slurm_job": "42"}, created=1_700_000_000)
    assert CheckpointMeta.from_json(meta.to_json()) == meta


def test_a_failed_dumps_log_is_kept_before_the_partial_goes(tmp_path: Path) -> None:
    from oomguard.store.names import LAST_FAILED_LOG

    store = Store(tmp_path / "store")
    images, lock_fd = store.begin(make_meta("failed-one"))
    import os

    os.close(lock_fd)
    (images / "dump.log").write_text("(00.1) Error (criu/cr-dump.c:1): it went wrong\n")
    store.keep_failed_log("failed-one")
    store.abort("failed-one")
    assert not store.partials()
    assert "it went wrong" in (store.root / LAST_FAILED_LOG).read_text()
