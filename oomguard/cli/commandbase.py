"""What every command shares: its exit statuses, the config it runs with (the CLI's config
file, then --store and --criu) and the backend it asks (the daemon, or the store itself)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from oomguard.config.discovery import CliConfig, discover_cli_config
from oomguard.config.loading import DaemonConfig
from oomguard.control.backend import Backend, open_backend
from oomguard.model.errors import BadInput
from oomguard.observe.logsetup import get_logger

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _cli_config(args: argparse.Namespace) -> CliConfig:
    found = discover_cli_config(args.global_config, getattr(args, "config", None))
    if found.fallback is not None:
        get_logger().debug("config.unreadable", config=found.fallback,
                           explanation="the embedded default stands in (its socket)")
    return found


def _base_config(args: argparse.Namespace) -> DaemonConfig:
    found = getattr(args, "cli_config", None)
    config = (found if found is not None else _cli_config(args)).config
    if args.store is not None:
        config = replace(config, store=args.store)
    criu = getattr(args, "criu", None)
    if criu:
        config = replace(config, criu=replace(config.criu, binary=criu))
    return config


# Verbs that may make the store they are given (the first checkpoint makes it).
MAKE_STORE_COMMANDS = ("checkpoint", "exec")


def _backend(args: argparse.Namespace) -> Backend:
    config = _base_config(args)
    if args.store is not None and args.socket is None \
            and args.command not in MAKE_STORE_COMMANDS and not args.store.is_dir():
        raise BadInput(f"--store {args.store}: no such directory (no checkpoint store there)")
    return open_backend(config, args.socket, store_given=args.store is not None)


def _call(args: argparse.Namespace, method: str, **parameters: Any) -> dict[str, Any]:
    backend = _backend(args)
    try:
        return backend.call(method, **parameters)
    finally:
        backend.close()

