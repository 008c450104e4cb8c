"""A daemon killed during a podman checkpoint leaves the archive under its .partial name; the
next daemon settles it before it acts: kept under its name where podman finished it, removed
where it was cut short and the container runs on. Here the real daemon, the real files, and a
stand-in for podman's `container inspect` (podman cannot run containers on this v1 host; the
engine part of the v2 lane does this with real podman and a real container)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zstandard

from tests.helpers import daemon, short_socket_path

pytestmark = pytest.mark.integration

FINISHED, CUT = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
FAKE_PODMAN = """#!/bin/sh
# podman container inspect --format FORMAT ID, as podman answers it for two containers
case "$5" in
  {finished}) echo "exited true" ;;
  {cut}) echo "running false" ;;
  *) echo "Error: no such container $5" >&2; exit 125 ;;
esac
"""


def test_the_last_runs_container_archives_are_settled_at_start(store: Path,
                                                                tmp_path: Path) -> None:
    podman = tmp_path / "podman"
    podman.write_text(FAKE_PODMAN.format(finished=FINISHED, cut=CUT))
    podman.chmod(0o755)
    containers = store / "containers"
    containers.mkdir(parents=True, mode=0o700)
    whole = zstandard.ZstdCompressor(write_checksum=True).compress(os.urandom(500_000))
    finished = containers / f"{FINISHED}-20261207T120000.tar.zst.partial"
    finished.write_bytes(whole)
    cut = containers / f"{CUT}-20261207T120001.tar.zst.partial"
    cut.write_bytes(whole[: len(whole) // 2])
    config = tmp_path / "oomguard.toml"
    sock = short_socket_path()
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{sock}"\n\n'
                      f'[podman]\nengine = "on"\ncommand = ["{podman}"]\n')
    with daemon(store, tmp_path / "daemon.log", socket=sock, config=config) as guard:
        kept = guard.wait_event("podman.recovered", timeout=60)[0]
        removed = guard.wait_event("podman.partial_removed", timeout=60)[0]
    archive = containers / f"{FINISHED}-20261207T120000.tar.zst"
    assert kept["archive"] == str(archive) and kept["container_id"] == FINISHED, kept
    assert kept["restore"] == f"podman container restore --import {archive}"
    assert archive.read_bytes() == whole and stat.S_IMODE(archive.stat().st_mode) == 0o600
    assert removed["container_id"] == CUT and "running" in removed["why"], removed
    assert not finished.exists() and not cut.exists()
    assert sorted(p.name for p in containers.iterdir()) == [archive.name]
    # The archives' directory is the store's own: no entry skipped, nothing else said
    said = {e["event"] for e in guard.events() if e.get("level") in ("warning", "error")}
    assert said == {"podman.recovered", "podman.partial_removed", "guard.idle"}, said
