"""`oomguard status` shows what happened before the daemon restarted: its events of note are
kept in the store (STORE/.history.jsonl, root's alone), read back by the next daemon."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from tests.helpers import (
    CgroupFactory,
    MiB,
    daemon,
    hog_argv,
    kill_pid,
    run_oomguard,
    short_socket_path,
    start_in_cgroup,
)


def test_status_history_survives_a_restart(cgroups: CgroupFactory, store: Path,
                                           tmp_path: Path) -> None:
    cg = cgroups.make("history", 128 * MiB)
    sock = short_socket_path()
    log = tmp_path / "daemon.log"
    with daemon(store, log, "--cgroup", str(cg.path), socket=sock) as guard:
        guard.wait_event("guard.armed")
        hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=200, rate=200,
                                           count=100_000))
        try:
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            assert done["pid"] == hog.pid
        finally:
            kill_pid(hog.pid)
            hog.wait(timeout=10)
        first = guard.handle.pid
    history = store / ".history.jsonl"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    kept = [json.loads(line) for line in history.read_text().splitlines()]
    assert any(e["event"] == "checkpoint.done" and e["id"] == done["id"] for e in kept), kept
    # A new daemon, which never checkpointed anything, shows the first one's checkpoint.
    with daemon(store, tmp_path / "daemon2.log", "--cgroup", str(cg.path),
                socket=sock) as again:
        again.wait_event("guard.armed")
        assert again.handle.pid != first
        assert not again.events("checkpoint.done")
        status = run_oomguard(store, "--socket", str(sock), "status", "--json")
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["pid"] == again.handle.pid
        assert any(e.get("event") == "checkpoint.done" and e.get("id") == done["id"]
                   for e in shown["recent_events"]), shown["recent_events"]
        text = run_oomguard(store, "--socket", str(sock), "status")
        assert "checkpoint.done" in text.stdout, text.stdout  # (the line is cut at 120)
