"""Desktop notifications end to end: the real daemon checkpoints a real process and emits its
D-Bus signal on a (private) system bus; the real notification agent turns it into an
org.freedesktop.Notifications.Notify call on a (private) session bus, where a minimal
notification server records it — this machine has no desktop to show it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from oomguard.observe.notifyagent import NotificationAgent
from tests.helpers import CgroupFactory, MiB, daemon, hog_argv, start_in_cgroup
from tests.unit.test_dbusnotify import (  # noqa: F401 - fixtures
    Buses,
    NotificationServer,
    buses,
    server,
)

pytestmark = pytest.mark.integration


def test_checkpoint_reaches_the_users_desktop_with_the_restore_command(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, buses: Buses,  # noqa: F811
        server: NotificationServer) -> None:  # noqa: F811
    cg = cgroups.make("notify", 256 * MiB)
    config = tmp_path / "dbus.toml"
    config.write_text(f'[daemon]\ndbus_address = "{buses.system.address}"\n\n'
                      f'[[guard]]\ncgroups = ["{cg.path}"]\n')
    agent = NotificationAgent(buses.system.address, buses.session.address, uid=os.getuid(),
                              poll_interval=0.1)
    agent.subscribe()
    stop = threading.Event()
    shown: list[int] = []
    listener = threading.Thread(target=lambda: shown.append(agent.run(stop=stop, max_events=1)))
    listener.start()
    try:
        with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
            guard.wait_event("guard.armed")
            hog = start_in_cgroup(cg, hog_argv(tmp_path / "hog.log", target=400, rate=300,
                                               count=100_000))
            done = guard.wait_event("checkpoint.done", timeout=60)[0]
            hog.wait(timeout=10)
            assert server.received.wait(20), "no notification reached the session bus"
        app, _replaces, _icon, summary, body, *_rest = server.calls[0]
        assert app == "oomguard" and summary == "Checkpointed to save memory"
        assert f"oomguard restore {done['id']}" in body and f"pid {hog.pid}" in body
    finally:
        stop.set()
        listener.join(timeout=10)
        agent.close()
    assert shown == [1]
