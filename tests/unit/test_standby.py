"""The standby (oomguard/daemon/standby.py, standbyguard.py): what it hears from the daemon,
when a cgroup is over its level, holding and giving up, and the process itself started,
told, said goodbye to, orphaned and relieved. The cgroups are scratch directories with the
files it reads; the processes it stops are real sleeping children of the test."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oomguard.cgroup.watch import OOM_KILL_KEY
from oomguard.daemon.standby import Standby, Watched, listen
from oomguard.daemon.standbyguard import JsonLog, StandbyGuard, over_level
from oomguard.model.errors import CgroupGone
from oomguard.store.ledger import SavedLimits
from oomguard.store.names import FROZEN_LEDGER, STANDBY_RECORD
from tests.helpers import REPO, wait_until
from tests.unit._support import MiB, sleeping_processes, task_state


def scratch_cgroup(root: Path, name: str, usage: int, rss: int, cache: int,
                   pids: list[int], under_oom: bool = False) -> Path:
    path = root / "memory" / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (path / "memory.stat").write_text(f"total_rss {rss}\ntotal_cache {cache}\n")
    (path / "memory.oom_control").write_text(
        f"oom_kill_disable 1\nunder_oom {int(under_oom)}\noom_kill 0\n")
    (path / "memory.limit_in_bytes").write_text(f"{256 * MiB}\n")
    (path / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
    return path


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """[a, b, the standby's stand-in]: the test's children are all the test's descendants, so
    a standby run inside the test is a sibling of the processes it stops."""
    with sleeping_processes(3) as pids:
        yield pids


# -- what it hears -----------------------------------------------------------------------------

def test_it_listens_until_the_end_and_a_goodbye_means_nothing_to_do() -> None:
    lines = [{"guard": "/m/a", "level": 100, "mount": "/m", "deadline": 30.0},
             {"guard": "/m/b", "level": 200, "mount": "/m", "deadline": 45.0},
             "not json", ["a list"], {"guard": "/m/c"},  # garbage and half a message: skipped
             {"guard": "/m/a", "level": 150, "mount": "/m", "deadline": 30.0},
             {"drop": "/m/b"}]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    heard = listen(io.BytesIO(text.encode()))
    assert heard == {"/m/a": Watched(Path("/m/a"), 150, Path("/m"), 30.0)}
    assert listen(io.BytesIO(text.encode() + b'{"bye": true}\n')) is None


# -- when a cgroup is over its level -----------------------------------------------------------

def test_over_the_level_is_resident_memory_or_a_park(tmp_path: Path) -> None:
    level = 200 * MiB
    low = scratch_cgroup(tmp_path, "low", 150 * MiB, 140 * MiB, 10 * MiB, [])
    (low / "memory.stat").unlink()  # below the level by usage alone: nothing else is read
    assert over_level(low, level) == (False, 150 * MiB)
    cache = scratch_cgroup(tmp_path, "cache", 250 * MiB, 100 * MiB, 150 * MiB, [])
    assert over_level(cache, level) == (False, 250 * MiB)  # page cache, not resident
    grown = scratch_cgroup(tmp_path, "grown", 230 * MiB, 210 * MiB, 20 * MiB, [])
    assert over_level(grown, level) == (True, 230 * MiB)
    parked = scratch_cgroup(tmp_path, "parked", 256 * MiB, 100 * MiB, 156 * MiB, [],
                            under_oom=True)
    assert over_level(parked, level)[0]
    with pytest.raises(CgroupGone):
        over_level(tmp_path / "memory" / "gone", level)


# -- holding, relieved, giving up --------------------------------------------------------------

def test_it_holds_a_cgroup_over_its_level_and_leaves_it_to_the_next_daemon(
        tmp_path: Path, sleepers: list[int]) -> None:
    over, under, me = sleepers
    hot = scratch_cgroup(tmp_path, "hot", 230 * MiB, 210 * MiB, 20 * MiB, [over])
    cool = scratch_cgroup(tmp_path, "cool", 50 * MiB, 40 * MiB, 10 * MiB, [under])
    out = io.StringIO()
    guard = StandbyGuard(tmp_path / "frozen.json", tmp_path / "saved.json", JsonLog(out),
                         self_pid=me)
    watched = [Watched(p, 200 * MiB, tmp_path / "memory", 30.0) for p in (hot, cool)]
    held: dict[Path, Any] = {}
    guard.round(watched, held)
    assert list(held) == [hot] and held[hot].pids == [over]
    assert wait_until(lambda: task_state(over) == "T", 10.0)
    assert task_state(under) != "T"
    assert [e["pid"] for e in json.loads((tmp_path / "frozen.json").read_text())] == [over]
    guard.relieved.set()  # SIGTERM from the next daemon
    assert guard.run(watched) == 0
    assert task_state(over) == "T"  # left stopped, recorded: the next daemon continues it
    events = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert events == ["standby.held", "standby.guarding", "standby.relieved"]


def test_without_a_new_daemon_it_gives_the_cgroups_back_to_the_kernel(
        tmp_path: Path, sleepers: list[int]) -> None:
    over, _, me = sleepers
    hot = scratch_cgroup(tmp_path, "hot", 230 * MiB, 210 * MiB, 20 * MiB, [over])
    SavedLimits(tmp_path / "saved.json").remember(str(hot) + OOM_KILL_KEY, 0)
    out = io.StringIO()
    clock = iter([0.0, 0.0, 0.0, 0.01, 0.02, 31.0])
    guard = StandbyGuard(tmp_path / "frozen.json", tmp_path / "saved.json", JsonLog(out),
                         clock=lambda: next(clock), self_pid=me)
    assert guard.run([Watched(hot, 200 * MiB, tmp_path / "memory", 30.0)]) == 0
    assert wait_until(lambda: task_state(over) != "T", 10.0)  # continued
    assert (hot / "memory.oom_control").read_text() == "0"  # the user's original
    assert SavedLimits(tmp_path / "saved.json").items() == {}
    assert json.loads((tmp_path / "frozen.json").read_text()) == []
    gave_up = json.loads(out.getvalue().splitlines()[-1])
    assert gave_up["event"] == "standby.gave_up" and gave_up["continued"] == [over]
    assert gave_up["settings_restored"] == [str(hot)]


# -- the process -------------------------------------------------------------------------------

class Log:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.seen.append((event, fields))


def _standby(store: Path) -> Standby:
    store.mkdir(exist_ok=True)
    return Standby(store, Log())


def test_a_goodbye_ends_it_and_its_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.chdir(REPO)
    standby = _standby(tmp_path / "store")
    standby.tell("/m/a", 100, "/m", 30.0)  # before take_over: kept, nothing started
    assert standby.handle is None
    assert standby.take_over() is None  # no previous one
    assert standby.handle is not None
    pid = standby.handle.pid
    assert json.loads((tmp_path / "store" / STANDBY_RECORD).read_text())["pid"] == pid
    handle = standby.handle
    standby.bye()
    assert handle.returncode == 0 and not (tmp_path / "store" / STANDBY_RECORD).exists()


def test_an_orphaned_standby_guards_until_the_next_daemon_relieves_it(
        tmp_path: Path, sleepers: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    over, _, _ = sleepers
    hot = scratch_cgroup(tmp_path, "hot", 230 * MiB, 210 * MiB, 20 * MiB, [over])
    store = tmp_path / "store"
    first = _standby(store)
    first.take_over()
    first.tell(str(hot), 200 * MiB, str(tmp_path / "memory"), 30.0)
    assert first.handle is not None and first.handle.stdin is not None
    orphan = first.handle
    orphan.stdin.close()  # the daemon died: end of its stdin, no goodbye
    assert wait_until(lambda: task_state(over) == "T", 10.0), "the standby did not hold the cgroup"
    second = _standby(store)
    assert second.take_over() == orphan.pid  # relieved, and waited for
    assert orphan.poll() == 0
    assert task_state(over) == "T"  # the next daemon continues it (thaw_leftovers)
    entries = json.loads((store / FROZEN_LEDGER).read_text())
    assert [e["pid"] for e in entries] == [over] and entries[0]["owner"] == orphan.pid
    second.bye()


def test_a_stale_record_names_nobody(tmp_path: Path, sleepers: list[int]) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / STANDBY_RECORD).write_text(json.dumps({"pid": sleepers[0], "start": 1}))  # reused pid
    assert _standby(store).relieve_previous() is None
    assert task_state(sleepers[0]) != "gone"
    (store / STANDBY_RECORD).write_text("garbage")
    assert _standby(store).relieve_previous() is None


def test_it_is_light(tmp_path: Path) -> None:
    """It sits beside the daemon for its whole life: no structlog, no CRIU, no pyroute2."""
    code = ("import sys, oomguard.daemon.standby, oomguard.daemon.standbyguard; "
            "print(' '.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, check=True).stdout.split()
    assert not [m for m in loaded if m.split(".")[0] in ("structlog", "pyroute2", "psutil")
                or m in ("oomguard.act.criu", "oomguard.act.freezer")]


def test_one_that_cannot_be_recorded_is_not_kept(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The next start finds a standby through its record: one that could not be recorded would
    guard on its own after a crash, so it is ended and the daemon says it goes without."""
    monkeypatch.chdir(REPO)
    store = tmp_path / "store"
    store.mkdir()
    (store / STANDBY_RECORD).mkdir()  # the record cannot be written (a rename never replaces a directory)
    standby = _standby(store)
    standby.tell("/m/a", 100, "/m", 30.0)
    standby.take_over()
    assert standby.handle is None and standby.failed
    assert [event for event, _ in standby.log.seen] == ["standby.unavailable"]
    standby.tell("/m/b", 100, "/m", 30.0)  # not tried again
    assert standby.handle is None
