"""A store holding symlinks and mangled meta.json files: the daemon starts and guards, warns
once per bad entry, and list/show/forget keep working for the good ones (they used to crash)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

from oomguard.store.checkpoints import META
from tests.helpers import (
    REPO,
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    oomguard_argv,
    start_in_cgroup,
)
from tests.unit.test_store import make_meta


def test_daemon_and_cli_survive_symlinks_and_malformed_entries(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("hostile", 256 * MiB)
    store.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep me")
    (elsewhere / META).write_text(make_meta("evil").to_json())
    (store / "evil").symlink_to(elsewhere)
    for name, text in {"nulls": json.dumps({**asdict(make_meta("nulls")), "pid": None,
                                             "created": None}),
                       "huge": json.dumps({**asdict(make_meta("huge")), "rss_bytes": 10**40}),
                       "deep": "[" * 50_000 + "]" * 50_000}.items():
        (store / name).mkdir(mode=0o700)
        (store / name / META).write_text(text)
    with daemon(store, tmp_path / "daemon.log", "--cgroup", str(cg.path)) as guard:
        guard.wait_event("guard.armed")
        skipped = guard.wait_event("store.entry_skipped", count=4, timeout=30)
        assert sorted(e["entry"] for e in skipped) == ["deep", "evil", "huge", "nulls"]
        # It still guards: a hog is checkpointed, and the new checkpoint lists fine.
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                           count=100_000))
        done = guard.wait_event("checkpoint.done", timeout=60)[0]
        hog.wait(timeout=10)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            argv = [a for a in oomguard_argv(store) if a not in ("--store", str(store))]
            return subprocess.run([*argv, "--socket", str(guard.socket), *args],
                                  capture_output=True, text=True, timeout=60, cwd=REPO,
                                  stdin=subprocess.DEVNULL)

        listed = cli("list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [m["id"] for m in json.loads(listed.stdout)] == [done["id"]]
        assert listed.stderr.count("skipped") == 4
        shown = cli("show", "nulls")
        assert shown.returncode == 1 and "meta.json" in shown.stderr
        forgot = cli("forget", "evil")
        assert forgot.returncode == 1 and "symlink" in forgot.stderr
        assert cli("show", done["id"]).returncode == 0
        # Warned once per entry, however often the store is scanned.
        assert len(guard.events("store.entry_skipped")) == 4
    assert (elsewhere / "precious").read_text() == "keep me"
    assert all((store / name).exists() for name in ("evil", "nulls", "huge", "deep"))
