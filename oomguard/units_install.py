"""`oomguard install-units`: the systemd unit, pointed at this oomguard, and the default config."""

from __future__ import annotations

import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from oomguard.config import embedded_config_text

SHIPPED_EXEC = "/usr/local/bin/oomguard"


def unit_text(executable: str) -> str:
    text = resources.files("oomguard").joinpath("data/oomguard.service").read_text()
    return text.replace(SHIPPED_EXEC, executable)


def this_executable() -> str:
    """The `oomguard` script of this installation (the venv's, for scripts/setup)."""
    beside = Path(sys.executable).parent / "oomguard"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("oomguard") or SHIPPED_EXEC


def install_units(unit_dir: Path, config_dir: Path, executable: str | None = None) -> list[Path]:
    written = []
    unit_dir.mkdir(parents=True, exist_ok=True)
    unit = unit_dir / "oomguard.service"
    tmp = unit.with_suffix(".tmp")
    tmp.write_text(unit_text(executable or this_executable()))
    tmp.chmod(0o644)
    tmp.replace(unit)
    written.append(unit)
    config = config_dir / "oomguard.toml"
    if not config.exists():
        config_dir.mkdir(parents=True, exist_ok=True)
        config.write_text(embedded_config_text())
        config.chmod(0o644)
        written.append(config)
    return written
