"""Keeping the checkpoint store: finishing or discarding what a crashed run left, thawing what
it left stopped, pruning by age and size, its listing, and the dump throughput this machine's
checkpoints show (bringing checkpoints back once they fit: autorestore.py)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.act.podman import PodmanEngine
from oomguard.act.podmanpartials import BUSY, KEPT, REMOVED, partials_in, settle_partial
from oomguard.config.loading import DaemonConfig
from oomguard.detect.timetolimit import DEFAULT_THROUGHPUT
from oomguard.model.errors import StoreError
from oomguard.policy.forecast import updated_throughput
from oomguard.policy.retention import Prune
from oomguard.store.budget import StoreBudget
from oomguard.store.checkpoints import CheckpointMeta, Store
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import CONTAINERS_DIR

PRUNE_INTERVAL = 60.0
LISTING_MAX_AGE = 10.0  # listed() reads the store again at least this often
# A container archive still being written is looked at again this often, not on every tick:
# each look walks every process's fds in /proc, on the loop's thread.
ARCHIVES_RECHECK = 10.0


class StoreUpkeep:
    def __init__(self, store: Store, ledger: FrozenLedger, config: DaemonConfig, log: Any, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 podman: PodmanEngine | None = None) -> None:
        self.store = store
        self.podman = podman
        # The container archives a dead run left half named, still to settle (podmanpartials)
        self._archives: list[Path] = []
        self._archives_said: set[Path] = set()
        self._next_archives = 0.0
        self.ledger = ledger
        self.config = config
        self.log = log
        self.clock = clock
        self.wall_clock = wall_clock
        self._next_prune = 0.0
        self._over_said = False  # store.over_budget said, not yet back under
        self._budget: StoreBudget | None = None
        self._partials_busy = False
        self._next_partials = 0.0  # incomplete checkpoints (a failed commit) are retried then
        self._skipped_warned: set[str] = set()  # store entries already warned about
        self._busy_logged: set[str] = set()  # partials being written, already logged once
        self.throughput = DEFAULT_THROUGHPUT  # dump bytes/s, learnt from this machine's dumps
        self._listing: tuple[tuple[int, int] | None, float, list[CheckpointMeta]] | None = None
        # The daemon's: whether a task a dead run left stopped waits (its cgroup is acted on).
        self.hold_back: Callable[[int], bool] | None = None
        # The daemon's: the tasks of paged-out trees (theirs to continue, not a crash's).
        self.paged_out: Callable[[], frozenset[int]] = frozenset

    def forget_listing(self) -> None:
        """A checkpoint's state changed inside its own directory (a restore): read it again."""
        self._listing = None

    def after_dump(self, image_bytes: int, dump_seconds: float) -> None:
        """A checkpoint was committed: its throughput noted, the store pruned."""
        self.note_dump(image_bytes, dump_seconds)
        self.prune()

    def note_dump(self, image_bytes: int, dump_seconds: float) -> None:
        self.throughput = updated_throughput(self.throughput, image_bytes, dump_seconds)

    def recover_store(self) -> None:
        """At start, first: partial dumps (a CRIU still at work keeps its tasks), and container
        archives podman was writing when the last run died; and learn this machine's dump
        throughput from the checkpoints already in the store."""
        self._recover_store()
        # Only what is there now: this run's own checkpoints write .partial archives too.
        self._archives = partials_in(self.store.root / CONTAINERS_DIR)
        self._settle_archives()
        for meta in self.store.list():
            self.note_dump(meta.image_bytes, meta.dump_seconds)

    def thaw_leftovers(self) -> None:
        """At start, once the guards are armed: thaw what a dead run left stopped (a victim
        still over its threshold is then caught again at once, not left to the OOM killer)."""
        self._thaw_leftovers()

    def tick(self) -> bool:
        """What could not be settled at start, and retention when it is due. True while
        something waits (a dead run's CRIU still writing, a leftover not yet thawed, one
        another oomguard process still holds): the daemon asks again soon."""
        if self._partials_busy or self.clock() >= self._next_partials:
            self._recover_store()
        if self._archives and self.clock() >= self._next_archives:
            self._settle_archives()
        pending = self.ledger.pending()
        if pending:
            self._thaw_leftovers()
            pending = self.ledger.pending()
        if self.clock() >= self._next_prune:
            self.prune()
        # Held by another oomguard process (the last run's standby, relieved but still on its
        # way out): its tasks are this daemon's to continue the moment it is gone.
        return self._partials_busy or bool(self._archives) or pending \
            or self.ledger.held_elsewhere()

    def _settle_archives(self) -> None:
        """The last run's .partial container archives: kept, removed, or left (said once);
        those still being written are looked at again on the next tick."""
        self._next_archives = self.clock() + ARCHIVES_RECHECK
        waiting = []
        for partial in self._archives:
            try:
                found = settle_partial(partial, self.podman)
            except OSError as exc:
                self.log.error("podman.partial_failed", partial=str(partial), error=str(exc))
                continue
            fields = {"partial": str(partial), "container_id": found.container,
                      "why": found.why}
            if found.outcome == BUSY:
                waiting.append(partial)
                if partial not in self._archives_said:
                    self._archives_said.add(partial)
                    self.log.info("podman.partial_busy", **fields,
                                  explanation="the last run's podman checkpoint is still at "
                                  "work; looked at again until it is done")
            elif found.outcome == KEPT:
                self.log.warning("podman.recovered", **fields, archive=str(found.archive),
                                 restore=f"podman container restore --import {found.archive}",
                                 explanation="podman finished the checkpoint the last run "
                                 "asked for after that run died: kept under its name")
            elif found.outcome == REMOVED:
                self.log.warning("podman.partial_removed", **fields,
                                 explanation="a checkpoint cut short when the last run died; "
                                 "the container was not checkpointed and runs on")
            else:
                self.log.error("podman.partial_left", **fields,
                               explanation="a container archive the last run did not finish "
                               "naming, left as it is: look at it (podman container restore "
                               "--import FILE may still bring the container back)")
        self._archives = waiting

    def listed(self) -> list[CheckpointMeta]:
        """The store's checkpoints, read again only when its directory changed (a checkpoint
        committed, forgotten or pruned), after one of this daemon's restores, or after
        LISTING_MAX_AGE (another process's restore changes only a meta.json)."""
        try:
            st = os.stat(self.store.root)
            key: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except OSError:
            key = None
        now = self.clock()
        if self._listing is None or self._listing[0] != key or now >= self._listing[1]:
            self._listing = (key, now + LISTING_MAX_AGE, self.store.list())
        return self._listing[2]

    def waiting_cgroups(self) -> set[str]:
        """The cgroups (as /proc/PID/cgroup names them) with a checkpoint waiting to be
        restored."""
        return {m.cgroup for m in self.listed() if m.state == "checkpointed"}

    def _thaw_leftovers(self) -> None:
        paged = self.paged_out()  # a crash between a page-out's record and the ledger's
        if paged:  # clearing: the tree is paged out, never continued into memory not there
            with contextlib.suppress(OSError):
                self.ledger.clear(sorted(paged))
        thawed = self.ledger.recover(self.hold_back)
        if thawed:
            self.log.warning("victim.thawed_after_crash", thawed=thawed,
                             explanation="a previous run stopped these and did not finish")

    def _recover_store(self) -> None:
        self._partials_busy = False
        self._next_partials = self.clock() + PRUNE_INTERVAL
        busy: set[str] = set()
        for checkpoint_id, what in self.store.recover_partials():
            if what == "completed":
                self.log.warning("checkpoint.recovered", id=checkpoint_id,
                                 explanation="the dump had finished when the last run died")
            elif what.startswith("incomplete"):
                self.log.error("checkpoint.incomplete", id=checkpoint_id,
                               reason=what.partition(": ")[2],
                               explanation="its process was dumped and is gone; the images "
                               "are intact and kept; the commit is retried every minute and "
                               "on restore")
            elif what == "removed":
                self.log.warning("checkpoint.partial_removed", id=checkpoint_id,
                                 explanation="an unfinished dump of the last run; its process "
                                 "was resumed by CRIU")
            else:
                self._partials_busy = True
                busy.add(checkpoint_id)
                if checkpoint_id not in self._busy_logged:  # once, not on every rescan
                    self.log.info("checkpoint.partial_busy", id=checkpoint_id,
                                  explanation="a CRIU (this run's dump in progress, or one "
                                  "left by the last run) is still writing it; looked at "
                                  "again on every rescan until it is done")
        self._busy_logged = busy

    def prune(self) -> None:
        """Retention, every PRUNE_INTERVAL: restored checkpoints past store_max_age, and
        restored ones (oldest first) while the store is over its budget; never one that has
        not been restored (a store still over budget is said, once until it is back under)."""
        self._next_prune = self.clock() + PRUNE_INTERVAL
        scan = self.store.scan()
        for name, why in scan.skipped:
            if name not in self._skipped_warned:
                self._skipped_warned.add(name)
                self.log.warning("store.entry_skipped", entry=name, reason=why,
                                 explanation="left as it is: not listed, restored or pruned")
        try:
            reading, pruned = self.budget().make_room()
        except StoreError as exc:
            self.log.error("store.unreadable", error=str(exc))
            return
        self.log_pruned(pruned)
        if reading.over() and not self._over_said:
            self.log.warning("store.over_budget", **reading.fields(),
                             explanation=f"{reading.describe()}; what is left is not restored "
                             "yet and is never deleted: new checkpoints are refused until "
                             "restores (or `oomguard forget`) make room")
        self._over_said = reading.over()

    def budget(self) -> StoreBudget:
        """The budget as the configuration (reloaded or not) says now (one object: its
        cache of the store's use is kept)."""
        if self._budget is None:
            self._budget = StoreBudget(self.store, None, None, wall_clock=self.wall_clock)
        budget, config = self._budget, self.config
        budget.max_size, budget.keep_free = config.store_max_size, config.store_keep_free
        budget.max_age = config.store_max_age
        return budget

    def log_pruned(self, pruned: list[Prune]) -> None:
        for prune in pruned:
            self.log.warning("store.pruned", id=prune.id, bytes=prune.size, reason=prune.reason)
