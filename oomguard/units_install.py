"""`oomguard install-units`: the systemd unit, pointed at this oomguard, and the default config."""

from __future__ import annotations

import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from oomguard.config import embedded_config_text

SHIPPED_EXEC = "/usr/local/bin/oomguard"


def unit_text(executable: str, name: str = "oomguard.service") -> str:
    text = resources.files("oomguard").joinpath(f"data/{name}").read_text()
    return text.replace(SHIPPED_EXEC, executable)


def this_executable() -> str:
    """The `oomguard` script of this installation (the venv's, for scripts/setup)."""
    beside = Path(sys.executable).parent / "oomguard"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("oomguard") or SHIPPED_EXEC


def _write_unit(directory: Path, name: str, executable: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    unit = directory / name
    tmp = unit.with_suffix(".tmp")
    tmp.write_text(unit_text(executable, name))
    tmp.chmod(0o644)
    tmp.replace(unit)
    return unit


def install_units(unit_dir: Path, config_dir: Path, executable: str | None = None,
                  user_unit_dir: Path | None = None) -> list[Path]:
    """The system service, the per-user notification agent (a user unit: `systemctl --user
    enable --now oomguard-notify-agent`), and the default config if there is none."""
    exe = executable or this_executable()
    written = [_write_unit(unit_dir, "oomguard.service", exe)]
    if user_unit_dir is not None:
        written.append(_write_unit(user_unit_dir, "oomguard-notify-agent.service", exe))
    config = config_dir / "oomguard.toml"
    if not config.exists():
        config_dir.mkdir(parents=True, exist_ok=True)
        config.write_text(embedded_config_text())
        config.chmod(0o644)
        written.append(config)
    return written
