"""The kubelet's checkpoint API, for containers: oomguard does not dump a container's processes
behind its runtime's back. It maps a kubepods cgroup (pod UID, container id) to namespace, pod
and container names with the kubelet's /pods, then asks the kubelet to checkpoint it:

    POST https://NODE:10250/checkpoint/{namespace}/{pod}/{container}
    -> {"items": ["/var/lib/kubelet/checkpoints/checkpoint-POD_NS-CONTAINER-TIME.tar"]}

(the ContainerCheckpoint feature, beta and on by default since Kubernetes 1.30; the caller
needs `create` on nodes/checkpoint and `get` on nodes/proxy). The archive is what a new pod is
restored from (docs/cluster.md). Standard library only; the opener is injectable."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from oomguard.model.errors import OomguardError

TOKEN_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
CA_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")


class KubeletError(OomguardError):
    """The kubelet refused or could not be reached."""


@dataclass(frozen=True)
class ContainerRef:
    namespace: str
    pod: str
    container: str


def strip_runtime(container_id: str) -> str:
    """'containerd://abc…' -> 'abc…' (how /pods shows it vs. how the cgroup names it)."""
    return container_id.split("://", 1)[-1]


def find_container(pods: list[dict[str, Any]], pod_uid: str,
                   container_id: str | None) -> ContainerRef | None:
    """The names of a pod's container from the kubelet's /pods list."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("uid") != pod_uid:
            continue
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        for status in statuses:
            if container_id is None or strip_runtime(str(status.get("containerID", ""))) == \
                    container_id:
                return ContainerRef(str(meta["namespace"]), str(meta["name"]),
                                    str(status["name"]))
    return None


@dataclass
class KubeletClient:
    base_url: str = "https://127.0.0.1:10250"
    token_file: Path | None = TOKEN_FILE
    ca_file: Path | None = CA_FILE  # None: the kubelet's serving certificate is not verified
    timeout: float = 300.0
    opener: Any = field(default=None, repr=False)

    def _request(self, method: str, path: str) -> Any:
        request = urllib.request.Request(self.base_url.rstrip("/") + path, method=method)
        if self.token_file is not None and self.token_file.exists():
            request.add_header("Authorization",
                               f"Bearer {self.token_file.read_text().strip()}")
        context = None
        if self.base_url.startswith("https://"):
            context = ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file and self.ca_file.exists() else None)
            if self.ca_file is None:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
        open_url = self.opener or urllib.request.urlopen
        try:
            with open_url(request, timeout=self.timeout, context=context) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip()[:500]
            raise KubeletError(f"kubelet {method} {path}: HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise KubeletError(f"kubelet {method} {path}: {exc}") from exc

    def pods(self) -> list[dict[str, Any]]:
        items = self._request("GET", "/pods").get("items") or []
        return list(items)

    def checkpoint(self, ref: ContainerRef) -> list[str]:
        """The archive(s) the kubelet wrote. The container keeps running."""
        path = "/checkpoint/" + "/".join(quote(p, safe="") for p in
                                          (ref.namespace, ref.pod, ref.container))
        found = self._request("POST", path).get("items") or []
        if not found:
            raise KubeletError(f"kubelet checkpoint of {ref} returned no archive")
        return [str(item) for item in found]


class ContainerCheckpointer:
    """A kubepods victim's container, checkpointed by its kubelet."""

    def __init__(self, client: KubeletClient) -> None:
        self.client = client

    def checkpoint(self, pod_uid: str, container_id: str | None) -> tuple[ContainerRef, list[str]]:
        ref = find_container(self.client.pods(), pod_uid, container_id)
        if ref is None:
            raise KubeletError(f"the kubelet lists no container {container_id or '?'} in pod "
                               f"{pod_uid}")
        return ref, self.client.checkpoint(ref)
