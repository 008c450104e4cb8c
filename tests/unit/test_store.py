"""oomguard.store.checkpoints: the checkpoint store in a temporary directory."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

import pytest

from oomguard.model.errors import StoreError
from oomguard.store.checkpoints import (
    IMAGES,
    META,
    PARTIAL_PREFIX,
    CheckpointMeta,
    Store,
    dir_size,
    new_id,
    validate_id,
)
from oomguard.store.names import CHECKPOINT_LOCK


def make_meta(checkpoint_id: str = "20250101-120000-4242-abcd", *, created: float = 1_700_000_000.0,
              **overrides: object) -> CheckpointMeta:
    values: dict[str, object] = dict(
        id=checkpoint_id, pid=4242, pids=[4242, 4243], command="python3 train.py --epochs 3",
        comm="python3", uid=1000, user="alice", cgroup="/jobs/build", cgroup_version=1,
        rss_bytes=200 << 20, reason="resident memory at 86% of limit", criu_version="4.2",
        created=created)
    values.update(overrides)
    return CheckpointMeta(**values)  # type: ignore[arg-type]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def st(tmp_path: Path) -> Store:
    return Store(tmp_path / "var" / "lib" / "oomguard")


def begin_meta(store: Store, meta: CheckpointMeta) -> Path:
    """Store.begin returns the images dir and a lock fd (handed to CRIU in real use)."""
    images_dir, lock_fd = store.begin(meta)
    os.close(lock_fd)
    return images_dir


def begin(store: Store, checkpoint_id: str) -> Path:
    return begin_meta(store, make_meta(checkpoint_id))


def checkpoint(store: Store, meta: CheckpointMeta, images: dict[str, bytes] | None = None) -> Path:
    images_dir = begin_meta(store, meta)
    for name, data in (images or {"pages-1.img": b"\0" * 8192, "inventory.img": b"inv"}).items():
        (images_dir / name).write_bytes(data)
    return store.commit(meta)


# -- ensure --------------------------------------------------------------------------------------

def test_ensure_creates_0700(st: Store) -> None:
    st.ensure()
    assert st.root.is_dir()
    assert mode_of(st.root) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711, 0o701, 0o777])
def test_ensure_tightens_existing_root(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(mode)
    Store(root).ensure()
    assert mode_of(root) == 0o700


def test_ensure_keeps_0700_and_contents(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    (root / "keep").write_text("x")
    Store(root).ensure()
    assert mode_of(root) == 0o700
    assert (root / "keep").read_text() == "x"


def test_ensure_unusable_root(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match="cannot use store"):
        Store(tmp_path / "file" / "store").ensure()


# -- ids -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "bad",
    ["..", ".", "/", ".x", "", "a/b", "../etc", "/abs", "-leading-dash", "_leading", "a b",
     "a\0b", "a" * 129, "é", "x.y", "a\\b"],
    ids=repr,
)
def test_validate_id_rejects(bad: str) -> None:
    with pytest.raises(StoreError, match="invalid checkpoint id"):
        validate_id(bad)


@pytest.mark.parametrize("good", ["a", "0", "20250101-120000-4242-ab12", "A_b-C", "a" * 128])
def test_validate_id_accepts(good: str) -> None:
    assert validate_id(good) == good


def test_validate_id_rejects_trailing_newline() -> None:
    with pytest.raises(StoreError):
        validate_id("abc\n")


def test_new_id_is_valid_and_sortable() -> None:
    a = new_id(4242, 0.0)
    assert a.startswith("19700101-000000-4242-")
    assert validate_id(a) == a
    assert new_id(1, 86400.0)[:15] > a[:15]


@pytest.mark.parametrize("bad", ["..", "a/b", ".partial-x"])
def test_paths_validate_ids(st: Store, bad: str) -> None:
    for call in (st.path_of, st.images_of, st.abort, st.get, st.forget,
                 lambda i: st.begin(make_meta(i))):
        with pytest.raises(StoreError):
            call(bad)
    assert not st.root.exists() or list(st.root.iterdir()) == []


# -- begin / commit / abort ----------------------------------------------------------------------

def test_begin_makes_partial(st: Store) -> None:
    images = begin(st, "ck1")
    assert images == st.root / (PARTIAL_PREFIX + "ck1") / IMAGES
    assert images.is_dir()
    assert mode_of(images) == 0o700
    assert mode_of(images.parent) == 0o700
    assert mode_of(st.root) == 0o700
    assert st.partials() == [images.parent]
    assert st.list() == []  # a partial is not a checkpoint


def test_begin_twice_fails(st: Store) -> None:
    begin(st, "ck1")
    with pytest.raises(StoreError, match="cannot create checkpoint"):
        begin(st, "ck1")


def test_commit(st: Store) -> None:
    meta = make_meta("ck1")
    final = checkpoint(st, meta, {"pages-1.img": b"x" * 10000, "core-4242.img": b"y" * 300})
    assert final == st.root / "ck1"
    assert sorted(p.name for p in st.root.iterdir()) == ["ck1"]  # no partial left
    assert st.partials() == []
    # No .tmp left; the lock file its dump held (and its restores take) goes with it.
    assert sorted(p.name for p in final.iterdir()) == [CHECKPOINT_LOCK, "XXH128SUMS", IMAGES, META]
    assert (final / IMAGES / "pages-1.img").read_bytes() == b"x" * 10000
    assert mode_of(final / META) == 0o600
    assert meta.image_bytes == 10300
    assert st.images_of("ck1") == final / IMAGES
    on_disk = json.loads((final / META).read_text())
    assert on_disk == asdict(meta)
    assert st.get("ck1") == meta


def test_meta_round_trip_all_fields(st: Store) -> None:
    meta = make_meta("ck2", pidns=True, dump_seconds=1.25, state="restored", restored_at=5.5,
                     restored_pid=31337, restored_cgroup="/jobs/other", cgroup_version=2,
                     extra={"note": "x", "n": [1, 2]})
    checkpoint(st, meta)
    assert st.get("ck2") == meta
    assert CheckpointMeta.from_json(meta.to_json()) == meta


def test_meta_unknown_keys_ignored() -> None:
    data = asdict(make_meta("ck3"))
    data["added_in_v9"] = {"whatever": True}
    data["another"] = 1
    assert CheckpointMeta.from_json(json.dumps(data)) == make_meta("ck3")


def test_meta_missing_optional_keys_take_defaults() -> None:
    data = asdict(make_meta("ck4"))
    for key in ("pidns", "image_bytes", "state", "restored_at", "extra"):
        del data[key]
    meta = CheckpointMeta.from_json(json.dumps(data))
    assert (meta.pidns, meta.image_bytes, meta.state, meta.restored_at, meta.extra) == (
        False, 0, "checkpointed", None, {})


def test_abort_removes_partial(st: Store) -> None:
    images = begin(st, "ck5")
    (images / "pages-1.img").write_bytes(b"z" * 100)
    st.abort("ck5")
    assert not images.parent.exists()
    assert st.partials() == []
    st.abort("ck5")  # twice is fine
    st.abort("never-begun")


def test_partial_with_meta_is_not_listed(st: Store) -> None:
    images = begin(st, "ck6")
    (images.parent / META).write_text(make_meta("ck6").to_json())
    assert st.list() == []
    with pytest.raises(StoreError, match="no checkpoint 'ck6'"):
        st.get("ck6")


# -- list / get / forget / update ----------------------------------------------------------------

def test_list_sorted_by_created(st: Store) -> None:
    checkpoint(st, make_meta("b-late", created=300.0))
    checkpoint(st, make_meta("a-early", created=100.0))
    checkpoint(st, make_meta("c-mid", created=200.0))
    begin(st, "d-partial")
    assert [m.id for m in st.list()] == ["a-early", "c-mid", "b-late"]


def test_list_skips_junk(st: Store) -> None:
    checkpoint(st, make_meta("good"))
    (st.root / "no-meta").mkdir()
    (st.root / "broken").mkdir()
    (st.root / "broken" / META).write_text("{not json")
    (st.root / "incomplete").mkdir()
    (st.root / "incomplete" / META).write_text('{"id": "incomplete"}')
    (st.root / "a-file").write_text("x")
    (st.root / ".hidden").mkdir()
    (st.root / ".hidden" / META).write_text(make_meta(".hidden").to_json())
    assert [m.id for m in st.list()] == ["good"]


def test_list_of_missing_store(st: Store) -> None:
    assert st.list() == []
    assert st.partials() == []
    assert not st.root.exists()  # listing does not create it


def test_list_skips_non_object_meta(st: Store) -> None:
    checkpoint(st, make_meta("good"))
    (st.root / "weird").mkdir()
    (st.root / "weird" / META).write_text("null\n")
    assert [m.id for m in st.list()] == ["good"]


def test_get_unknown(st: Store) -> None:
    with pytest.raises(StoreError, match=r"no checkpoint 'nope' in .*oomguard"):
        st.get("nope")


def test_get_unreadable_meta(st: Store) -> None:
    checkpoint(st, make_meta("ck7"))
    (st.root / "ck7" / META).write_text('{"id": "ck7"}')
    with pytest.raises(StoreError, match=r"unreadable meta\.json"):
        st.get("ck7")


def test_forget(st: Store) -> None:
    checkpoint(st, make_meta("keep"))
    checkpoint(st, make_meta("drop"))
    st.forget("drop")
    assert not (st.root / "drop").exists()
    assert [m.id for m in st.list()] == ["keep"]
    with pytest.raises(StoreError, match="no checkpoint 'drop'"):
        st.forget("drop")


def test_forget_leaves_partial_alone(st: Store) -> None:
    begin(st, "ck8")
    with pytest.raises(StoreError):
        st.forget("ck8")
    assert st.partials() == [st.root / (PARTIAL_PREFIX + "ck8")]


def test_update(st: Store) -> None:
    meta = make_meta("ck9")
    checkpoint(st, meta)
    meta.state = "restored"
    meta.restored_pid = 999
    meta.restored_at = 1_700_000_100.0
    meta.restored_cgroup = "/jobs/bigger"
    st.update(meta)
    again = st.get("ck9")
    assert (again.state, again.restored_pid, again.restored_at, again.restored_cgroup) == (
        "restored", 999, 1_700_000_100.0, "/jobs/bigger")
    assert again.image_bytes == meta.image_bytes
    assert sorted(p.name for p in (st.root / "ck9").iterdir()) == \
        [CHECKPOINT_LOCK, "XXH128SUMS", IMAGES, META]


def test_dir_size_counts_files_recursively(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"2" * 5)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert dir_size(tmp_path) == 15
