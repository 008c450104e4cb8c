"""install-units: ExecStart through the stable /usr/local/bin/oomguard when it runs this
oomguard, the unit's --config following --config-dir, and the next steps it prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oomguard.cli.install_units import Installed, report, this_executable, unit_text

OWN = Path(sys.executable).parent / "oomguard"
needs_own = pytest.mark.skipif(not OWN.is_file(), reason="no oomguard script beside python")


@needs_own
def test_the_stable_link_is_used_when_it_runs_this_oomguard(tmp_path: Path) -> None:
    stable = tmp_path / "bin" / "oomguard"
    stable.parent.mkdir()
    stable.symlink_to(OWN)
    assert this_executable(stable) == str(stable)


@needs_own
def test_a_stable_path_running_another_oomguard_is_not_used(tmp_path: Path) -> None:
    other = tmp_path / "other" / "oomguard"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    stable = tmp_path / "oomguard"
    stable.symlink_to(other)
    assert this_executable(stable) == str(OWN)
    assert this_executable(tmp_path / "absent") == str(OWN)


def test_the_unit_runs_the_executable_on_the_installed_config() -> None:
    text = unit_text("/opt/og/bin/oomguard", config=Path("/srv/og/oomguard.toml"))
    assert "ExecStart=/opt/og/bin/oomguard run --config /srv/og/oomguard.toml\n" in text
    agent = unit_text("/opt/og/bin/oomguard", "oomguard-notify-agent.service")
    assert "ExecStart=/opt/og/bin/oomguard notify-agent\n" in agent


def _installed(tmp_path: Path, *, written: bool, stable: bool) -> Installed:
    return Installed(units=(tmp_path / "oomguard.service",), user_unit=None,
                     config=Path("/etc/oomguard/oomguard.toml"), config_written=written,
                     executable="/usr/local/bin/oomguard" if stable else "/w/.venv/bin/oomguard",
                     stable=stable)


def test_without_guards_the_first_step_is_a_guard(tmp_path: Path) -> None:
    text = "\n".join(report(_installed(tmp_path, written=True, stable=True), guards=0))
    assert "1. add a [[guard]] rule to /etc/oomguard/oomguard.toml" in text
    assert "oomguard check-config /etc/oomguard/oomguard.toml" in text
    assert "2. start the service" in text and "systemctl enable --now oomguard" in text
    assert "note:" not in text and "notify-agent" not in text


def test_with_guards_it_goes_straight_to_systemctl_and_notes_an_unstable_path(
        tmp_path: Path) -> None:
    text = "\n".join(report(_installed(tmp_path, written=False, stable=False), guards=2))
    assert "[[guard]]" not in text
    assert "kept /etc/oomguard/oomguard.toml (2 guard rules)" in text
    assert "1. start the service" in text and "systemctl daemon-reload" in text
    assert "note: the units run /w/.venv/bin/oomguard" in text
