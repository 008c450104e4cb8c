"""The daemon: the guard loop (loop.py), how guards are armed (arming.py), what the cgroup
filesystem says changed (sense/cgroupfiles.py) and when each kind of work is due."""

from oomguard.daemon.loop import Daemon

__all__ = ["Daemon"]
