"""Auto-restore: a guarded cgroup's oldest checkpoint brought back once it fits under the
threshold with a margin, for `restore_quiet` without interruption; one restore at a time, in
a thread of its own; a failed one said and retried after RESTORE_BACKOFF."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from oomguard.cgroup.base import MemorySnapshot
from oomguard.daemon.guards import CgroupGuard
from oomguard.lifecycle.restore import Restorer, failure_fields, memory_pages_bytes
from oomguard.model.errors import OomguardError
from oomguard.observe.events import EventSink, RestoreDone, RestoreFailed, sink_for
from oomguard.policy.pressure import restore_fits
from oomguard.store.checkpoints import Store

RESTORE_BACKOFF = 60.0  # a failed auto-restore is retried after this long


class AutoRestorer:
    """`restored`: called after each restore that succeeded (the keeper reads the store's
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
                   and self._backoff.get(m.id, 0.0) <= now]
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
        after RESTORE_BACKOFF."""
        assert self.restorer is not None
        try:
            result = self.restorer.restore(checkpoint_id, original=guard.cgroup)
        except (OomguardError, OSError) as exc:
            self._backoff[checkpoint_id] = self.clock() + RESTORE_BACKOFF
            self.events.publish(RestoreFailed(checkpoint_id, failure_fields(exc), guard.name,
                                              retry_in_s=RESTORE_BACKOFF))
            return
        self.restored()
        self.events.publish(RestoreDone(result, guard=guard.name))
