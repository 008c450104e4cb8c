"""The Kubernetes DaemonSet and RBAC shipped in deploy/kubernetes: validated against Kubernetes'
own OpenAPI schemas (kubernetes-validate, from PyPI: kubeconform's releases are not on the
package registries this machine reaches), checked field by field for what the schema cannot
know (the kubelet reached on the node's network, the mounts), and the embedded oomguard config
validated by oomguard's own parser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from oomguard.config.loading import load_config_text
from oomguard.sense.owners import kube_container

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "oomguard.yaml"


def documents() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        assert doc["metadata"].get("name"), doc
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("version", ["1.29.0", "1.30.0", "1.31.0"])
def test_the_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    """Strict: an unknown field anywhere (a misspelt hostNetwork) fails."""
    validate = pytest.importorskip("kubernetes_validate", reason="pip install -e .[dev]")
    for doc in (d for d in yaml.safe_load_all(MANIFEST.read_text()) if d):
        validate.validate(doc, version, strict=True)


def test_a_misspelt_field_fails_the_schema_check() -> None:
    validate = pytest.importorskip("kubernetes_validate", reason="pip install -e .[dev]")
    ds = documents()["DaemonSet"]
    ds["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(validate.ValidationError, match="hostNetwrk"):
        validate.validate(ds, "1.30.0", strict=True)


def test_every_object_is_there_once() -> None:
    kinds = [d["kind"] for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert sorted(kinds) == sorted(["Namespace", "ServiceAccount", "ClusterRole",
                                    "ClusterRoleBinding", "ConfigMap", "DaemonSet"])


def test_rbac_grants_the_kubelet_checkpoint_api_and_no_more() -> None:
    docs = documents()
    rules = docs["ClusterRole"]["rules"]
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    assert ("nodes/checkpoint", "create") in granted
    assert all(v in ("get", "create", "list") for _, v in granted)
    assert not any(r in ("secrets", "*") for r, _ in granted)
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": docs["ClusterRole"]["metadata"]["name"]}
    subject = binding["subjects"][0]
    assert (subject["kind"], subject["name"], subject["namespace"]) == (
        "ServiceAccount", docs["ServiceAccount"]["metadata"]["name"],
        docs["ServiceAccount"]["metadata"]["namespace"])


def test_daemonset_runs_privileged_in_the_hosts_pid_namespace_with_its_mounts() -> None:
    docs = documents()
    ds = docs["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    pod = spec["template"]["spec"]
    assert pod["hostPID"] is True and pod["serviceAccountName"] == "oomguard"
    # kubelet_url's default, https://127.0.0.1:10250, is the node's own: its network namespace.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == set(volumes)
    assert mounts["cgroup"] == "/sys/fs/cgroup" and volumes["cgroup"]["hostPath"]["path"] == \
        "/sys/fs/cgroup"
    assert volumes["store"]["hostPath"]["path"] == mounts["store"] == "/var/lib/oomguard"
    assert volumes["config"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert container["args"][:3] == ["run", "--config", "/etc/oomguard/oomguard.toml"]
    assert "env" not in container  # nothing reads NODE_NAME
    for doc in (docs["ServiceAccount"], docs["ConfigMap"], ds):
        assert doc["metadata"]["namespace"] == docs["Namespace"]["metadata"]["name"]


def test_embedded_config_is_valid_and_its_globs_match_pod_cgroups() -> None:
    text = documents()["ConfigMap"]["data"]["oomguard.toml"]
    config = load_config_text(text, "ConfigMap oomguard-config")
    assert str(config.store) == "/var/lib/oomguard"
    (guard,) = config.guards
    uid = "6b1a4c2e_9f3d_4e8a_b7c6_0d1e2f3a4b5c"
    for pattern in guard.cgroups:
        path = pattern.replace("pod*", f"pod{uid}")
        found = kube_container(path)
        assert found is not None and found.pod_uid == uid.replace("_", "-"), path
