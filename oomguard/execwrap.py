"""`oomguard exec -- CMD`: start a workload as PID 1 of its own PID namespace, in a session of
its own, so its checkpoint always restores (CRIU restores PIDs; inside a fresh namespace they
are always free). See docs and ../shared/docs/kernel-notes.md."""

from __future__ import annotations

import shutil
from collections.abc import Sequence


def exec_argv(command: Sequence[str]) -> list[str]:
    """`unshare --pid --fork` makes CMD's process PID 1 of a new namespace (no --mount-proc: CRIU
    would have to dump a mount namespace); `setsid` gives it its own session."""
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    setsid = shutil.which("setsid") or "/usr/bin/setsid"
    return [unshare, "--pid", "--fork", setsid, *command]
