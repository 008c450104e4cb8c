"""The kubelet checkpoint client against a stand-in kubelet (an HTTP server in the test: no
kubelet runs here) — the request it makes, the names it maps, the errors it reports."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from oomguard.act.kubelet import ContainerRef, KubeletClient, KubeletError, find_container

UID = "6b1a4c2e-9f3d-4e8a-b7c6-0d1e2f3a4b5c"
CID = "3f1c9a0e" * 8
PODS = {"items": [
    {"metadata": {"uid": "other", "namespace": "x", "name": "y"}, "status": {}},
    {"metadata": {"uid": UID, "namespace": "ml", "name": "trainer-0"},
     "status": {"containerStatuses": [
         {"name": "sidecar", "containerID": "containerd://" + "0" * 64},
         {"name": "trainer", "containerID": "containerd://" + CID}]}},
]}


class Kubelet(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str, str | None]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, self.headers.get("Authorization")))
        self._reply(200, PODS) if self.path == "/pods" else self._reply(404, b"not found")

    def do_POST(self) -> None:
        self.seen.append(("POST", self.path, self.headers.get("Authorization")))
        if self.path.startswith("/checkpoint/ml/trainer-0/"):
            name = self.path.rsplit("/", 1)[1]
            self._reply(200, {"items": [f"/var/lib/kubelet/checkpoints/checkpoint-trainer-0_ml-"
                                        f"{name}-2026-11-30T19:00:00Z.tar"]})
        else:
            self._reply(403, b"Forbidden (user=system:serviceaccount:x:y, verb=create, "
                             b"resource=nodes, subresource(s)=[checkpoint])")


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[KubeletClient]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Kubelet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("sekrit\n")
    Kubelet.seen = []
    try:
        yield KubeletClient(f"http://127.0.0.1:{server.server_address[1]}", token_file=token,
                            ca_file=None, timeout=5)
    finally:
        server.shutdown()


def test_maps_the_cgroup_to_names_and_checkpoints(kubelet: KubeletClient) -> None:
    ref = find_container(kubelet.pods(), UID, CID)
    assert ref == ContainerRef("ml", "trainer-0", "trainer")
    archives = kubelet.checkpoint(ref)
    assert archives == ["/var/lib/kubelet/checkpoints/checkpoint-trainer-0_ml-trainer-"
                        "2026-11-30T19:00:00Z.tar"]
    assert Kubelet.seen == [("GET", "/pods", "Bearer sekrit"),
                            ("POST", "/checkpoint/ml/trainer-0/trainer", "Bearer sekrit")]


def test_refusal_names_the_missing_permission(kubelet: KubeletClient) -> None:
    with pytest.raises(KubeletError, match=r"HTTP 403: Forbidden .*subresource\(s\)=\[checkpoint\]"):
        kubelet.checkpoint(ContainerRef("other", "pod", "c"))


def test_unknown_pod_or_container() -> None:
    assert find_container(PODS["items"], "nope", None) is None
    assert find_container(PODS["items"], UID, "f" * 64) is None
    assert find_container(PODS["items"], UID, None) == ContainerRef("ml", "trainer-0", "sidecar")


def test_unreachable_kubelet_is_a_clear_error() -> None:
    client = KubeletClient("http://127.0.0.1:9", token_file=None, ca_file=None, timeout=2)
    with pytest.raises(KubeletError, match="kubelet GET /pods"):
        client.pods()
