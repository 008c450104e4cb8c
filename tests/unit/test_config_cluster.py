"""[slurm] and [kubernetes] in the config: values, defaults, and every bad key named."""

from __future__ import annotations

import pytest

from oomguard.config.loading import KubernetesConfig, SlurmConfig, parse_config
from oomguard.model.errors import ConfigError


def test_defaults_and_values() -> None:
    plain = parse_config({}, "t.toml")
    assert plain.slurm == SlurmConfig() and plain.kubernetes == KubernetesConfig()
    config = parse_config({"slurm": {"after_checkpoint": "requeuehold", "grow_memory": 2,
                                     "notify": "on", "scontrol": "/opt/slurm/bin/scontrol"},
                           "kubernetes": {"kubelet": "on", "kubelet_url": "https://node:10250",
                                          "ca_file": "/etc/kubernetes/pki/ca.crt"}}, "t.toml")
    assert config.slurm == SlurmConfig("on", "/opt/slurm/bin/scontrol", "requeuehold", 2.0)
    assert (config.kubernetes.kubelet, config.kubernetes.kubelet_url,
            config.kubernetes.ca_file) == ("on", "https://node:10250", "/etc/kubernetes/pki/ca.crt")


def test_bad_values_name_file_and_key() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"slurm": {"after_checkpoint": "cancel", "grow_memory": 100, "x": 1},
                      "kubernetes": {"kubelet": "maybe", "kubelet_url": "node:10250"}},
                     "/etc/oomguard/oomguard.toml")
    assert {i.key for i in caught.value.issues} == {
        "slurm.after_checkpoint", "slurm.grow_memory", "slurm.x", "kubernetes.kubelet",
        "kubernetes.kubelet_url"}
    assert {i.source for i in caught.value.issues} == {"/etc/oomguard/oomguard.toml"}
