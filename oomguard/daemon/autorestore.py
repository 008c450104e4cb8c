"""Auto-restore: a guarded cgroup's oldest checkpoint brought back once it fits under the
threshold with a margin, for `restore_quiet` without interruption; one restore at a time, in
a thread of its own; a failed one said and retried after the rule's `restore_retry`, and
after `restore_attempts` failures marked stuck in its meta.json (with the reason) and no
longer tried automatically: one that can never restore (a file it had open changed size) is
not retried forever. A person's `oomguard restore` may still try it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from oomguard.cgroup.base import MemorySnapshot
from oomguard.daemon.guards import CgroupGuard
from oomguard.lifecycle.restore import Restorer, memory_pages_bytes
from oomguard.lifecycle.restoreoutcome import failure_fields
from oomguard.model.errors import OomguardError, RestoreInProgress
from oomguard.observe.events import EventSink, RestoreDone, RestoreFailed, sink_for
from oomguard.policy.pressure import restore_fits
from oomguard.store.checkpoints import STATE_CHECKPOINTED, Store

RESTORE_BACKOFF = 60.0  # a failed auto-restore is retried after this long (restore_retry)


class AutoRestorer:
    """`restored`: called after each restore that succeeded (the upkeep reads the store's
    listing again)."""

    def __init__(self, store: Store, restorer: Restorer | None, log: Any, *,
                 events: EventSink | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 restored: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.restorer = restorer
        self.log = log
        self.events = sink_for(log, events)  # restore.done / restore.failed, auto
        self.clock = clock
        self.restored = restored
        self._restoring: threading.Thread | None = None
        self._backoff: dict[str, float] = {}  # checkpoint id -> not retried before then

    def consider(self, guard: CgroupGuard, snap: MemorySnapshot) -> None:
        """Start restoring this cgroup's oldest checkpoint if it is time (see the module)."""
        if self._restoring is not None and self._restoring.is_alive():
            return
        now = self.clock()
        waiting = [m for m in self.store.list()
                   if m.state == "checkpointed" and m.cgroup == guard.cgroup.rel_path
                   and not m.stuck and self._backoff.get(m.id, 0.0) <= now]
        if not waiting or self.restorer is None:
            guard.quiet_since = None
            return
        meta = waiting[0]
        need = memory_pages_bytes(self.store, meta.id)
        if not restore_fits(snap, need, guard.spec.restore_margin, guard.spec.threshold):
            guard.quiet_since = None
            return
        if guard.quiet_since is None:
            guard.quiet_since = now
        if now - guard.quiet_since < guard.spec.restore_quiet:
            return
        guard.quiet_since = None
        self.log.info("restore.auto", id=meta.id, cgroup=guard.name, image_bytes=need,
                      usage=snap.usage_bytes, limit=snap.limit_bytes)
        self._restoring = threading.Thread(target=self.restore, args=(guard, meta.id),
                                           name="oomguard-restore", daemon=True)
        self._restoring.start()

    def restore(self, guard: CgroupGuard, checkpoint_id: str) -> None:
        """One auto-restore, in the caller's thread; whatever fails is said, and retried
        after the rule's restore_retry, or marked stuck after restore_attempts failures."""
        assert self.restorer is not None
        try:
            result = self.restorer.restore(checkpoint_id, original=guard.cgroup)
        except (OomguardError, OSError) as exc:
            if isinstance(exc, RestoreInProgress) or isinstance(exc.__cause__, RestoreInProgress):
                # Another restore has it (a person's, or a lazy one still streaming in): a
                # race lost, not this checkpoint's failure.
                self._backoff[checkpoint_id] = self.clock() + guard.spec.restore_retry
                self.log.info("restore.raced", id=checkpoint_id, cgroup=guard.name, auto=True,
                              error=str(exc), explanation="another restore has this "
                              "checkpoint; looked at again after restore_retry (not counted "
                              "as a failure)")
                return
            failure = failure_fields(exc)
            retry = guard.spec.restore_retry
            self._backoff[checkpoint_id] = self.clock() + retry
            failures, stuck = self._count_failure(checkpoint_id, failure.get("error", str(exc)),
                                                  guard.spec.restore_attempts)
            self.events.publish(RestoreFailed(checkpoint_id, failure, guard.name,
                                              retry_in_s=None if stuck else retry))
            if stuck:
                self.log.error("restore.stuck", id=checkpoint_id, cgroup=guard.name,
                               attempts=failures, reason=stuck,
                               explanation="no longer restored automatically (`oomguard "
                               "list` shows it stuck); `oomguard restore ID` may still try")
            return
        self.restored()
        self.events.publish(RestoreDone(result, guard=guard.name))

    def _count_failure(self, checkpoint_id: str, reason: str, attempts: int) -> tuple[int, str]:
        """One more failed auto-restore in the checkpoint's meta.json; returns the count and
        the reason it is stuck ("" while it is tried again)."""
        try:
            meta = self.store.get(checkpoint_id)
            if meta.state != STATE_CHECKPOINTED:
                return 0, ""
            meta.restore_failures += 1
            if meta.restore_failures >= attempts:
                meta.stuck = reason
            self.store.update(meta)
        except (OomguardError, OSError) as exc:
            self.log.error("restore.count_failed", id=checkpoint_id, error=str(exc),
                           explanation="the failed attempt is not counted: tried again later")
            return 0, ""
        return meta.restore_failures, meta.stuck
