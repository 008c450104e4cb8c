"""Checkpoint ids as people type them: the whole id, a unique prefix of it, or `last` (the
newest checkpoint the caller may see); or a PID (`show PID`: the newest checkpoint whose tree
held that process). Pure functions of the candidates: the service layer
passes only the checkpoints the caller may see, so a prefix never matches (or reveals)
another user's checkpoint."""

from __future__ import annotations

from collections.abc import Iterable

from oomguard.model.checkpointmeta import CheckpointMeta
from oomguard.model.errors import AmbiguousId, UnknownCheckpoint

LAST = "last"
CANDIDATES_SHOWN = 10  # an ambiguous prefix lists at most this many matches
PID_DIGITS = 7  # pid_max is at most 4194304: eight digits or more begin a checkpoint id


def names_a_pid(target: str) -> bool:
    """`attach 4242` names a process; `attach 20250301` (a date: how ids begin) a checkpoint."""
    return target.isdigit() and len(target) <= PID_DIGITS


def held_pids(meta: CheckpointMeta) -> set[int]:
    """The PIDs a person may know a checkpoint's job by: every process of its tree when it was
    taken (its root, its main process), and its root once restored."""
    return {meta.pid, *meta.pids, *(p for p in (meta.job_pid, meta.restored_pid) if p)}


def newest_holding(pid: int, visible: Iterable[CheckpointMeta], *, whose: str = "",
                   job_root: int | None = None) -> str:
    """The id of the newest of `visible` whose tree held process `pid` (or, for a live `pid`,
    whose restored tree's root is `job_root`, its job's). Raises UnknownCheckpoint when none
    did."""
    wanted = {pid} if job_root is None else {pid, job_root}
    holding = [m for m in visible if wanted & held_pids(m)]
    if not holding:
        raise UnknownCheckpoint(f"no checkpoint{whose} of a tree that held process {pid}")
    return max(holding, key=lambda m: (m.created, m.id)).id


def resolve_id(text: str, visible: Iterable[CheckpointMeta], *, whose: str = "") -> str:
    """The id `text` names among `visible`: an exact id, `last`, or a unique prefix. Raises
    UnknownCheckpoint ("no checkpoint ...") when none matches, AmbiguousId when several do. `whose`
    ends the not-found message (" of yours")."""
    metas = list(visible)
    ids = [m.id for m in metas]
    if text in ids:
        return text
    if text == LAST:
        if not metas:
            raise UnknownCheckpoint(f"no checkpoint{whose} yet ('{LAST}' names the newest)")
        return max(metas, key=lambda m: (m.created, m.id)).id
    matches = sorted(i for i in ids if i.startswith(text))
    if not matches:
        raise UnknownCheckpoint(f"no checkpoint {text!r}{whose}")
    if len(matches) > 1:
        shown = ", ".join(matches[:CANDIDATES_SHOWN])
        more = f" and {len(matches) - CANDIDATES_SHOWN} more" if len(matches) > CANDIDATES_SHOWN \
            else ""
        raise AmbiguousId(f"checkpoint id {text!r} is ambiguous: it begins {len(matches)} "
                          f"checkpoints: {shown}{more}", matches)
    return matches[0]
