"""The verbs of the control interface, one table for both ways of reaching the store: the
daemon's socket (server.dispatch) and root's direct access without a daemon (backend's
LocalBackend). Each takes the Service, who calls, and the call's parameters (checked by kind:
protocol.param)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oomguard.control.protocol import param
from oomguard.control.service import Service


@dataclass(frozen=True)
class Caller:
    uid: int
    pid: int | None = None  # the calling process, where the kernel told it (SO_PEERCRED)
    socket: bool = False  # through the daemon's socket (False: root's CLI on the store)


Verb = Callable[[Service, Caller, dict[str, Any]], dict[str, Any]]

NEEDS_CRIU = frozenset({"Restore", "Checkpoint"})  # the only verbs that run CRIU


def _status(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return {"status": service.status(caller.uid)}


def _list(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return {"checkpoints": service.list(caller.uid), "skipped": service.skipped(caller.uid),
            "paged_out": service.paged_out(caller.uid)}


def _show(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return {"checkpoint": service.show(caller.uid, param(p, "id", str))}


def _restore(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return service.restore(caller.uid, param(p, "id", str),
                           param(p, "cgroup", str, required=False),
                           bool(param(p, "force", bool, required=False)),
                           lazy=bool(param(p, "lazy", bool, required=False)))


def _forget(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return service.forget(caller.uid, param(p, "id", str))


def _checkpoint(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    """A tree holding the asking process is refused (service.checkpoint's `requester`)."""
    default = "on demand (control socket)" if caller.socket else "on demand"
    reason = param(p, "reason", str, required=False) or default
    return {"checkpoint": service.checkpoint(caller.uid, param(p, "pid", int), reason,
                                             requester=caller.pid)}


def _resume(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return {"resumed": service.resume(caller.uid, param(p, "id", str))}


def _gpu_resume(service: Service, caller: Caller, p: dict[str, Any]) -> dict[str, Any]:
    return service.gpu_resume(caller.uid, param(p, "pid", int))


VERBS: dict[str, Verb] = {
    "Status": _status, "List": _list, "Show": _show, "Restore": _restore, "Forget": _forget,
    "Checkpoint": _checkpoint, "GpuResume": _gpu_resume, "Resume": _resume,
}
