"""The memory limits oomguard lifts for a dump's headroom: recorded before the lift,
bounded, shared by every oomguard process (the daemon, a CLI without a daemon), and put back
by whoever can once no live holder needs them — after a crash by the next daemon's start.

A lifted limit is never taken for the cgroup's own: its own limit is the recorded one. When the
old limit cannot be put back because the cgroup now uses more (something grew into the room
lifted for the dump), the entry stays "pending": the daemon retries, and acts on the grower.

Every value oomguard writes is recorded too ("lifted"), before it is written: a limit found to
be none of them (nor the own one) when it is to be put back was set by someone else meanwhile
(an administrator, while a crashed daemon's entry waited): it is left as it is, and the entry
dropped ("changed").
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.cgroup.base import LimitBusy, MemoryCgroup
from oomguard.model.errors import CgroupGone
from oomguard.sense.procfs import ProcReader
from oomguard.store.ledger import JsonRecord

LIFT_CEILING = 2  # a lift never exceeds the own limit + this many times the headroom
PAGE = mmap.PAGESIZE  # limits are kept in whole pages (read back rounded down)


@dataclass(frozen=True)
class Settled:
    path: str  # the cgroup directory
    outcome: str  # "restored" | "busy" | "gone" | "changed" (set by someone else: left)
    detail: str = ""


class LimitLifts:
    """`lift(cgroup, new_limit, cap)` -> release; `own_limit(path)`; `settle(cgroup_at)`."""

    def __init__(self, ledger: Path, proc: ProcReader | None = None,
                 owner: int | None = None) -> None:
        self.ledger = ledger
        # Outlives a dead oomguard (the page cache keeps it), or a limit stays lifted for good;
        # not fsync'd, as the frozen ledger is not: a dead machine takes its cgroups' limits
        # with it, and the lift taken at a crossing is on the way to SIGSTOP, where an fsync
        # behind a dump's writes can stall for long (store/ledger.py).
        self.record = JsonRecord(ledger, sync=False)
        self.proc = proc or ProcReader()
        self.owner = owner if owner is not None else os.getpid()
        self._owner_start = self.proc.starttime(self.owner)
        self._cache: tuple[tuple[int, int, int], dict[str, dict[str, Any]]] | None = None


    # -- the shared file ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, Any]]]:
        """The ledger, read and written under an flock (other oomguard processes) and a
        thread lock (this one's workers); written back when the block ends."""
        with self.record.locked():
            entries = self._load()
            before = json.dumps(entries, sort_keys=True)
            yield entries
            if json.dumps(entries, sort_keys=True) != before:
                self._save(entries)

    def _load(self) -> dict[str, dict[str, Any]]:
        data = self.record.read()
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict)
                and isinstance(v.get("state"), dict) and isinstance(v.get("holders"), list)}

    def _save(self, entries: dict[str, dict[str, Any]]) -> None:
        self.record.write(entries)

    def _alive(self, holder: list[Any]) -> bool:
        try:
            pid, start = int(holder[0]), int(holder[1])
        except (IndexError, TypeError, ValueError):
            return False
        if pid == self.owner and start == self._owner_start:
            return True
        return pid > 0 and start > 0 and self.proc.starttime(pid) == start

    # -- lifting ----------------------------------------------------------------------------------

    def lift(self, cgroup: MemoryCgroup, new_limit: int, cap: int | None = None,
             ) -> Callable[[], str | None]:
        """Lift the limit to `new_limit`, recorded first; with `cap` (the rule's headroom), never
        above the cgroup's own limit + 2 x cap: room for one dump, and for one more to seize a
        task parked at a limit that something grew into meanwhile, however many dumps ask.
        A memory.high below `new_limit` (v2; the guard's own mark at its threshold) is lifted
        with it, even where the limit itself needs no room: it throttles a stopped task still
        inside a system call, which stops only on its way out. Returns the release: the own
        limits are put back once no live holder is left; it returns None, or why they could
        not be put back yet (the entry stays pending)."""
        key = str(cgroup.path)
        token = secrets.token_hex(4)
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is None:
                entry = {"state": cgroup.limits_state(), "holders": [], "pending": False}
                entries[key] = entry
            entry["holders"].append([self.owner, self._owner_start, token])
            own = entry["state"].get("max")
            if own is not None and cap is not None:
                new_limit = min(new_limit, own + LIFT_CEILING * cap)
            current = cgroup.limit()
            raising = current is not None and (current < new_limit
                                               or throttles_below(cgroup, new_limit))
            if raising:  # what is about to be written
                entry["lifted"] = [*entry.get("lifted", []), _page(new_limit)]
        # Written before the limit changes; the raise itself outside the file lock.
        if raising:
            try:
                cgroup.raise_limit(new_limit)  # its own undo is not used: the ledger's is
            except BaseException:
                self._release(cgroup, token)
                raise
        return lambda: self._release(cgroup, token)

    def lower(self, cgroup: MemoryCgroup, new_limit: int) -> Callable[[], str | None]:
        """cgroup v1's way to make the kernel reclaim `usage - new_limit` bytes of a cgroup now
        (v2 has memory.reclaim): the limit set below usage for a moment, recorded first like a
        lift (a crash puts the own limit back at the next start), and put back by the
        release. The kernel reclaims before the write returns, or fails it with EBUSY where it
        cannot get under (nothing changed then). Returns the release."""
        key = str(cgroup.path)
        token = secrets.token_hex(4)
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is None:
                entry = {"state": cgroup.limits_state(), "holders": [], "pending": False}
                entries[key] = entry
            entry["holders"].append([self.owner, self._owner_start, token])
            current = cgroup.limit()
            lowering = current is None or new_limit < current
            if lowering:
                entry["lifted"] = [*entry.get("lifted", []), _page(new_limit)]
        if lowering:
            try:
                cgroup.set_limit(new_limit)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    self._release(cgroup, token)
                    raise
            except BaseException:
                self._release(cgroup, token)
                raise
        return lambda: self._release(cgroup, token)

    def _release(self, cgroup: MemoryCgroup, token: str) -> str | None:
        key = str(cgroup.path)
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is None:
                return None
            entry["holders"] = [h for h in entry["holders"]
                                if not (len(h) > 2 and h[2] == token) and self._alive(h)]
            if entry["holders"]:
                return None  # another dump still needs the room
            settled = self._put_back(entries, key, cgroup)
            return settled.detail if settled.outcome == "busy" else None

    def _put_back(self, entries: dict[str, dict[str, Any]], key: str,
                  cgroup: MemoryCgroup) -> Settled:
        entry = entries[key]
        changed = self._changed(entry, cgroup)
        if changed is not None:
            del entries[key]
            return Settled(key, "changed", changed)
        try:
            cgroup.put_back_limits(entry["state"])
        except LimitBusy as exc:
            entry["pending"] = True
            return Settled(key, "busy", str(exc.strerror or exc))
        except (CgroupGone, FileNotFoundError):
            del entries[key]
            return Settled(key, "gone")
        except OSError as exc:
            entry["pending"] = True
            return Settled(key, "busy", str(exc))
        del entries[key]
        return Settled(key, "restored")

    @staticmethod
    def _changed(entry: dict[str, Any], cgroup: MemoryCgroup) -> str | None:
        """Why the limit in force is not oomguard's to put back (someone else set it since it
        was lifted), or None. An entry without the values written (an older oomguard's) is
        put back as before."""
        lifted = entry.get("lifted")
        if not isinstance(lifted, list) or not lifted:
            return None
        try:
            current = cgroup.limit()
        except (OSError, CgroupGone):
            return None  # put_back_limits says what became of it
        own = entry["state"].get("max")
        if current == own:
            return None
        ours = {_page(v) for v in [*lifted, own] if isinstance(v, int)}
        if current is None or _page(current) not in ours:
            shown = "no limit" if current is None else f"{current}"
            return (f"the limit is {shown}, none of those oomguard set "
                    f"({', '.join(map(str, sorted(set(lifted))))}) over the own {own}: someone "
                    "else set it meanwhile, and it is left as it is")
        return None

    # -- what the daemon asks ---------------------------------------------------------------------

    def _current(self) -> dict[str, dict[str, Any]]:
        """The ledger as it is on disk, read again only when the file changed (the daemon asks
        for every guarded cgroup on every rescan)."""
        try:
            st = os.stat(self.ledger)
        except OSError:
            return {}
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._cache is None or self._cache[0] != stamp:
            self._cache = (stamp, self._load())
        return self._cache[1]

    def lifted(self, path: Path) -> bool:
        """Whether oomguard has this cgroup's limit lifted (or still owes putting it back)."""
        return str(path) in self._current()

    def pending(self) -> bool:
        """Whether any limit waits to be put back (or may have been left by a dead run)."""
        return bool(self._current())

    def own_limit(self, path: Path) -> tuple[bool, int | None]:
        """(True, the cgroup's own limit) while oomguard has it lifted; (False, None) else."""
        entry = self._current().get(str(path))
        if entry is None:
            return False, None
        own = entry["state"].get("max")
        return True, own if isinstance(own, int) and not isinstance(own, bool) else None

    def drop_changed(self, cgroup_at: Callable[[str], MemoryCgroup | None]) -> list[Settled]:
        """Drop the entries no live holder needs whose limit someone else set meanwhile
        (outcome "changed"; nothing is written to a cgroup): at a daemon's start, before
        its guards read their own limits from the ledger."""
        results = []
        with self._locked() as entries:
            for key in list(entries):
                entry = entries[key]
                if any(self._alive(h) for h in entry["holders"]):
                    continue
                cgroup = cgroup_at(key)
                changed = None if cgroup is None else self._changed(entry, cgroup)
                if changed is not None:
                    del entries[key]
                    results.append(Settled(key, "changed", changed))
        return results

    def settle(self, cgroup_at: Callable[[str], MemoryCgroup | None]) -> list[Settled]:
        """Put back every limit no live holder needs any more: pending ones, and those of dead
        oomguard processes. `cgroup_at(path)` opens a cgroup directory (None: not ours)."""
        results = []
        with self._locked() as entries:
            for key in list(entries):
                entry = entries[key]
                entry["holders"] = [h for h in entry["holders"] if self._alive(h)]
                if entry["holders"]:
                    continue
                cgroup = cgroup_at(key)
                if cgroup is None:
                    del entries[key]
                    results.append(Settled(key, "gone"))
                    continue
                results.append(self._put_back(entries, key, cgroup))
        return results


def _page(value: int) -> int:
    """A limit as the kernel keeps it (rounded down to whole pages)."""
    return value // PAGE * PAGE


def throttles_below(cgroup: MemoryCgroup, limit: int) -> bool:
    """Whether the cgroup's memory.high (v2; v1 has none) throttles below `limit`."""
    high = cgroup.limits_state().get("high")
    return high is not None and high < limit
