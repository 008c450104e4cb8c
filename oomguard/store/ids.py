"""Checkpoint ids as people type them: the whole id, a unique prefix of it, or `last` (the
newest checkpoint the caller may see). Pure functions of the candidates: the service layer
passes only the checkpoints the caller may see, so a prefix never matches (or reveals)
another user's checkpoint."""

from __future__ import annotations

from collections.abc import Iterable

from oomguard.model.errors import AmbiguousId, UnknownCheckpoint
from oomguard.store.checkpoints import CheckpointMeta

LAST = "last"
CANDIDATES_SHOWN = 10  # an ambiguous prefix lists at most this many matches


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
