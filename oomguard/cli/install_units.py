"""`oomguard install-units`: the systemd units, pointed at a stable `oomguard`, the default
config if there is none, and what to do next."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from oomguard.config.loading import DEFAULT_CONFIG_PATH, DaemonConfig, embedded_config_text, load_config
from oomguard.model.atomicfile import write_atomically

SHIPPED_EXEC = "/usr/local/bin/oomguard"  # scripts/setup links it to the checkout's .venv
SERVICE = "oomguard.service"
USER_AGENT = "oomguard-notify-agent.service"


@dataclass(frozen=True)
class Installed:
    units: tuple[Path, ...]
    user_unit: Path | None
    config: Path
    config_written: bool
    executable: str
    stable: bool  # ExecStart survives the checkout (or venv) moving


def unit_text(executable: str, name: str = SERVICE,
              config: Path = DEFAULT_CONFIG_PATH) -> str:
    text = resources.files("oomguard").joinpath(f"data/{name}").read_text()
    text = text.replace(f"--config {DEFAULT_CONFIG_PATH}", f"--config {config}")
    return text.replace(SHIPPED_EXEC, executable)


def _runs_this(candidate: Path, own: Path | None) -> bool:
    if not (candidate.is_file() and os.access(candidate, os.X_OK)):
        return False
    return own is None or candidate.resolve() == own.resolve()


def this_executable(stable: Path = Path(SHIPPED_EXEC)) -> str:
    """`stable` when it runs this installation (scripts/setup's link, a pip install in
    /usr/local), else the `oomguard` script of this installation (the venv's), else PATH's."""
    beside = Path(sys.executable).parent / "oomguard"
    own = beside if beside.is_file() and os.access(beside, os.X_OK) else None
    if _runs_this(stable, own):
        return str(stable)
    if own is not None:
        return str(own)
    return shutil.which("oomguard") or str(stable)


def _write_unit(directory: Path, name: str, executable: str, config: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    unit = directory / name
    write_atomically(unit, unit_text(executable, name, config), 0o644)
    return unit


def existing_config(config_dir: Path) -> DaemonConfig | None:
    """The config already in `config_dir`, validated (ConfigError), or None."""
    path = config_dir / "oomguard.toml"
    return load_config(path) if path.exists() else None


def install_units(unit_dir: Path, config_dir: Path, executable: str | None = None,
                  user_unit_dir: Path | None = None,
                  stable: Path = Path(SHIPPED_EXEC)) -> Installed:
    """The system service, the per-user notification agent (a user unit: `systemctl --user
    enable --now oomguard-notify-agent`), and the default config if there is none."""
    exe = executable or this_executable(stable)
    config = config_dir / "oomguard.toml"
    units = [_write_unit(unit_dir, SERVICE, exe, config)]
    user_unit = None
    if user_unit_dir is not None:
        user_unit = _write_unit(user_unit_dir, USER_AGENT, exe, config)
        units.append(user_unit)
    written = False
    if not config.exists():
        config_dir.mkdir(parents=True, exist_ok=True)
        config.write_text(embedded_config_text())
        config.chmod(0o644)
        written = True
    return Installed(tuple(units), user_unit, config, written, exe, exe == str(stable))


def report(done: Installed, guards: int) -> list[str]:
    """What install-units says: what it wrote, and the exact next steps."""
    lines = [f"installed {done.units[0]} (the service; ExecStart: {done.executable} run "
             f"--config {done.config})"]
    if done.user_unit is not None:
        lines.append(f"installed {done.user_unit} (a user unit: desktop notifications of "
                     "each user's checkpoints and restores)")
    lines.append(f"installed {done.config} (the default config: it guards nothing yet)"
                 if done.config_written else
                 f"kept {done.config} ({guards} guard rule{'' if guards == 1 else 's'})")
    if not done.stable:
        lines.append(f"note: the units run {done.executable}; if it moves, run install-units "
                     f"again (scripts/setup links {SHIPPED_EXEC}, which stays put)")
    lines.append("next:")
    step = 1
    if guards == 0:
        lines += [f"  {step}. add a [[guard]] rule to {done.config} (commented examples are in "
                  "it; without one the service starts but watches nothing), then check it:",
                  f"       oomguard check-config {done.config}"]
        step += 1
    lines += [f"  {step}. start the service now and at every boot:",
              "       systemctl daemon-reload",
              "       systemctl enable --now oomguard",
              "       oomguard status" if done.config == DEFAULT_CONFIG_PATH else
              f"       oomguard --config {done.config} status"]
    if done.user_unit is not None:
        lines += [f"  {step + 1}. optional, desktop notifications: each user, in their "
                  "graphical session:",
                  "       systemctl --user enable --now oomguard-notify-agent"]
    return lines
