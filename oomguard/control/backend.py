"""How the CLI reaches the store: through the daemon's control socket when it runs (any user;
the daemon decides what each may do), or directly when root runs it without a daemon."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from oomguard.config.loading import DaemonConfig
from oomguard.control.client import ControlClient, DaemonUnavailable
from oomguard.model.errors import OomguardError

if TYPE_CHECKING:  # loaded only where the store is acted on directly: the CLI talking to the
    # daemon starts in half the time without it (the checkpointer, CRIU, the store...)
    from oomguard.control.service import Service


class Backend(Protocol):
    def call(self, method: str, **parameters: Any) -> dict[str, Any]: ...

    def close(self) -> None: ...


class RemoteBackend:
    def __init__(self, client: ControlClient) -> None:
        self.client = client

    def call(self, method: str, **parameters: Any) -> dict[str, Any]:
        return self.client.call(method, **parameters)

    def close(self) -> None:
        self.client.close()


class LocalBackend:
    """The same verbs, served in-process for root (no daemon). CRIU is only located when a verb
    needs it."""

    def __init__(self, config: DaemonConfig) -> None:
        from oomguard.cgroup.mounts import read_layout
        from oomguard.sense.procfs import ProcReader

        self.config = config
        self.layout = read_layout()
        self.proc = ProcReader()
        self._service: Service | None = None
        self._criu_used = False

    def _get_service(self, needs_criu: bool) -> Service:
        from oomguard.control.realparts import build_service

        if self._service is None or (needs_criu and not self._criu_used):
            self._service = build_service(self.config, self.layout, self.proc,
                                          with_criu=needs_criu)
            self._criu_used = needs_criu
        return self._service

    def call(self, method: str, **p: Any) -> dict[str, Any]:
        from oomguard.control.protocol import ProtocolError
        from oomguard.control.verbs import NEEDS_CRIU, VERBS, Caller

        verb = VERBS.get(method)
        if verb is None:
            raise OomguardError(f"unknown verb {method}")
        service = self._get_service(needs_criu=method in NEEDS_CRIU)
        try:
            return verb(service, Caller(os.geteuid()), p)
        except ProtocolError as exc:  # a parameter of the wrong kind: a bug of the caller's
            raise OomguardError(f"{method}: {exc}") from exc

    def close(self) -> None:
        if self._criu_used:
            from oomguard.control.realparts import remove_criu_cgroup

            remove_criu_cgroup(self.layout, self.proc)


def open_backend(config: DaemonConfig, socket_path: Path | None, store_given: bool) -> Backend:
    """--socket: the daemon only. --store: directly (root). Neither: the daemon if it answers,
    else directly when root."""
    path = socket_path or config.socket
    if socket_path is not None or not store_given:
        try:
            return RemoteBackend(ControlClient(path))
        except DaemonUnavailable:
            if socket_path is not None:
                raise
    if os.geteuid() != 0:
        raise OomguardError(f"no oomguard daemon answers on {path}; without it only root can "
                            "reach the checkpoint store (it holds every secret of the processes)")
    return LocalBackend(config)
