"""systemd-oomd's prekill hook (systemd >= 260): before oomd kills a cgroup it calls
`io.systemd.oom.Prekill.Notify(cgroup)` on every socket in /run/systemd/oomd.prekill.hook/ and
waits (briefly) for the reply. oomguard answers by checkpointing the cgroup's process trees, so
what oomd then kills is already safe on disk. Only root and systemd-oomd's own user may call."""

from __future__ import annotations

import contextlib
import pwd
from typing import Any

from oomguard.control.protocol import (
    ERROR_DENIED,
    ERROR_FAILED,
    ERROR_INVALID,
    ERROR_METHOD,
    ProtocolError,
    decode_call,
    error,
    param,
    reply,
)
from oomguard.control.service import Service
from oomguard.model.errors import OomguardError

INTERFACE = "io.systemd.oom.Prekill"
METHOD = f"{INTERFACE}.Notify"
SOCKET_NAME = "io.oomguard.Prekill"
OOMD_USER = "systemd-oom"


def allowed_uids() -> frozenset[int]:
    uids = {0}
    with contextlib.suppress(KeyError):
        uids.add(pwd.getpwnam(OOMD_USER).pw_uid)
    return frozenset(uids)


def dispatch_prekill(service: Service, raw: bytes, uid: int, pid: int | None = None,
                     ) -> tuple[str, dict[str, Any]]:
    method = "?"
    try:
        call = decode_call(raw)
        method = call.method
        if uid not in allowed_uids():
            return method, error(ERROR_DENIED, "only root and systemd-oomd may call this")
        if method != METHOD:
            return method, error(ERROR_METHOD, f"no method {method!r}")
        cgroup = param(call.parameters, "cgroup", str)
        return method, reply(service.prekill(cgroup))
    except ProtocolError as exc:
        return method, error(ERROR_INVALID, str(exc))
    except OomguardError as exc:
        return method, error(ERROR_FAILED, str(exc))
