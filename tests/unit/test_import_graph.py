"""The import graph's layers (issue 17): the config at the bottom, the pure parts free of the
ones that act. Each import runs in a fresh interpreter, so nothing else loaded it first."""

from __future__ import annotations

import subprocess
import sys

import pytest

# oomguard.config.actions is the steps' grammar (the config parses chains with it): not acting.
ACTING = ("oomguard.lifecycle", "oomguard.act.criu", "oomguard.act.freezer", "oomguard.respond.chain",
          "oomguard.respond.actor", "oomguard.model.runner", "oomguard.store.checkpoints",
          "oomguard.daemon", "oomguard.control.service", "oomguard.terminal")


def loaded_by(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return {name for name in out.split() if name.startswith("oomguard")}


@pytest.mark.parametrize("module", ["oomguard.config.loading", "oomguard.policy.pressure",
                                    "oomguard.policy.guardlook",
                                    "oomguard.policy.victims", "oomguard.policy.preferences",
                                    "oomguard.policy.forecast", "oomguard.policy.retention",
                                    "oomguard.policy.systemrule", "oomguard.policy.rights",
                                    "oomguard.sense.cgroupfiles", "oomguard.sense.ranking",
                                    "oomguard.sense.procevents", "oomguard.sense.cnproc",
                                    "oomguard.detect.registry"])
def test_lower_layers_load_nothing_that_acts(module: str) -> None:
    loaded = loaded_by(module)
    assert not {name for name in loaded for acting in ACTING
                if name == acting or name.startswith(acting + ".")}, loaded


POLICY = ("pressure", "victims", "preferences", "forecast", "retention", "systemrule", "rights",
          "jobs", "guardlook")
# What a pure policy may load: the model, other policy modules, and the modules whose frozen
# types it takes (MemorySnapshot: cgroup; ProcessInfo: sense.procfs), never called from here,
# and the detection plug-ins (pure judgements of readings, below the config).
POLICY_MAY_LOAD = ("oomguard.model", "oomguard.policy", "oomguard.cgroup", "oomguard.sense.procfs",
                   "oomguard.detect")


@pytest.mark.parametrize("name", POLICY)
def test_the_policy_loads_only_the_model_and_the_types_it_decides_on(name: str) -> None:
    loaded = loaded_by(f"oomguard.policy.{name}") - {"oomguard", "oomguard.sense"}  # docstrings
    assert f"oomguard.policy.{name}" in loaded
    assert not {n for n in loaded if not any(n == ok or n.startswith(ok + ".")
                                              for ok in POLICY_MAY_LOAD)}, loaded


# What loading a config may load: the model and the config itself (the chain's grammar is
# oomguard.config.actions, which loads only the model), and the detection plug-ins, whose keys
# a rule holds (they load only the model). Not its checks against the machine, which read the
# cgroup tree. The CLI finds the daemon's socket in the config before anything else.
CONFIG_MAY_LOAD = ("oomguard.model", "oomguard.config", "oomguard.config.actions",
                   "oomguard.detect")


def test_the_config_is_at_the_bottom_of_the_import_graph() -> None:
    loaded = loaded_by("oomguard.config.discovery") - {"oomguard", "oomguard.act"}
    assert "oomguard.config.loading" in loaded and "oomguard.cgroup.configchecks" not in loaded
    assert not {n for n in loaded if not any(n == ok or n.startswith(ok + ".")
                                              for ok in CONFIG_MAY_LOAD)}, loaded


def test_the_cli_asks_the_daemon_before_loading_structlog_or_the_machine() -> None:
    """What `oomguard restore` loads before its request goes out: a lazily restored job runs
    that much sooner (structlog loads after the answer; the cgroup tree, psutil and CRIU's
    wiring only where the CLI acts on the store itself)."""
    code = ("import sys, oomguard.cli.main; "
            "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert not {"structlog", "psutil", "cgroupspy", "asyncio"} & set(out)
    assert not [n for n in out if n.startswith(("oomguard.cgroup", "oomguard.sense",
                                                "oomguard.daemon", "oomguard.store"))], out
