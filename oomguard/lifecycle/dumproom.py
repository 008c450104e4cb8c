"""The room a dump gets over its cgroup's limit: lifted, recorded first (oomguard/act/lifts.py),
bounded, and put back with an undo that says why it could not be (then the one who released
acts on the cgroup: a chain's next step, down to its kill, oomguard/respond/chainsteps.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from oomguard.act.lifts import LimitLifts, throttles_below
from oomguard.cgroup.base import MemoryCgroup, MemorySnapshot
from oomguard.model.errors import CgroupGone
from oomguard.policy.pressure import headroom_needed

Undo = Callable[[], str | None]  # returns why the limit could not be put back ("" or None: it was)


class DumpRoom:
    def __init__(self, lifts: LimitLifts) -> None:
        self.lifts = lifts

    def early(self, cgroup: MemoryCgroup | None, room: int) -> Undo | None:
        """The headroom lifted at once for a tree about to be stopped (where its dump would
        get it: a limited cgroup, headroom given): until the stop its cgroup's tasks run on,
        and at the limit a charge made inside a system call fails with ENOMEM (cgroup v1; v2
        while the OOM killer passes over the shielded tree), where a page fault would wait. A
        job growing at 1000 MB/s and writing its log fills the last 20 MiB under the limit in
        20 ms. Returns the release (it runs once), or None. A lift that fails is no reason to
        refuse: the dump lifts again after the stop."""
        if cgroup is None or room <= 0:
            return None
        try:
            release = self.hold(cgroup, room)
        except (OSError, CgroupGone):
            return None
        return None if release is None else once(release)

    def hold(self, cgroup: MemoryCgroup, room: int) -> Undo | None:
        """The limit lifted by `room` over what the cgroup uses now (bounded as a dump's lift
        is). Returns the release, or None (room enough, no limit, or none asked for)."""
        return self.over(cgroup, room, own=True, undo=None)

    def over(self, cgroup: MemoryCgroup | None, room: int, own: bool,
             undo: Undo | None, unthrottle: bool = False) -> Undo | None:
        """`room` over the cgroup's `own` limit, or over the limit in force (a lift already
        given may have been used up), added to `undo` (the lifts before it). `unthrottle`:
        with room enough, a memory.high below the limit in force is lifted to it all the same
        (oomguard/act/lifts.py), for a tree whose stop is waited for."""
        if cgroup is None or room <= 0:
            return undo
        reading = self.reading(cgroup, own=own)
        raised_limit = headroom_needed(reading, room)
        if raised_limit is None and unthrottle:
            raised_limit = _throttled_limit(cgroup)  # None: nothing to lift, nothing recorded
        if raised_limit is None:
            return undo
        return both(self.lift(cgroup, raised_limit, cap=room), undo)

    def lifted(self, path: Path) -> bool:
        """Whether oomguard has lifted this cgroup's limit (or still owes putting it back)."""
        return self.lifts.lifted(path)

    def reading(self, cgroup: MemoryCgroup, own: bool) -> MemorySnapshot:
        """Usage and limit only (what headroom needs; no memory.stat on the way to the dump),
        with the cgroup's `own` limit or the one in force."""
        lifted, own_limit = self.lifts.own_limit(cgroup.path) if own else (False, None)
        return MemorySnapshot(usage_bytes=cgroup.usage(),
                              limit_bytes=own_limit if lifted else cgroup.limit(),
                              anon_bytes=0, file_bytes=0, oom_kills=0, under_oom=False)

    def own_snapshot(self, cgroup: MemoryCgroup) -> MemorySnapshot:
        """A snapshot with the cgroup's own limit, not one oomguard lifted for a dump."""
        snap = cgroup.snapshot()
        lifted, own = self.lifts.own_limit(cgroup.path)
        return replace(snap, limit_bytes=own) if lifted else snap

    def lift(self, cgroup: MemoryCgroup, new_limit: int, cap: int | None = None) -> Undo:
        """The release returns why the limit could not be put back ("" or None: it was): it
        then stays pending in the ledger, and the one who released acts on the cgroup."""
        return self.lifts.lift(cgroup, new_limit, cap)


def _throttled_limit(cgroup: MemoryCgroup) -> int | None:
    """The limit in force where a memory.high below it throttles (lifted to it), else None."""
    limit = cgroup.limit()
    return limit if limit is not None and throttles_below(cgroup, limit) else None


def limited(cgroup: MemoryCgroup) -> bool:
    try:
        return cgroup.limit() is not None
    except (OSError, CgroupGone):
        return False


def once(release: Undo) -> Undo:
    """A release that acts the first time it is called, and answers None after."""
    pending = [release]

    def first_time() -> str | None:
        return pending.pop()() if pending else None
    return first_time


def both(last: Undo, first: Undo | None) -> Undo:
    """One undo for two limit lifts: the later one first (the first's answer is the one: the
    own limit is put back when the last holder lets go)."""
    if first is None:
        return last

    def undo() -> str | None:
        with contextlib.suppress(OSError, CgroupGone):
            last()
        return first()
    return undo
