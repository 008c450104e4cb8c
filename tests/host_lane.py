"""The workstation host lane (scripts/host-lane, docs/host-lane.md): Debian bookworm with systemd
as PID 1 on cgroup v2, booted under qemu, oomguard installed from its package."""

from __future__ import annotations

import os
import subprocess
import time

from tests.helpers import REPO


def run_host_lane(command: list[str], timeout: int, skip_codes: tuple[int, ...] = (77,),
                  ) -> tuple[subprocess.CompletedProcess[str], float]:
    """`command` as root in one boot of the host lane, after the package is installed and
    multi-user.target reached; returns the result and its wall time (boot included). Exits the
    test as skipped, with the lane's reason, on `skip_codes` (77: the lane cannot run here)."""
    import pytest

    argv = [str(REPO / "scripts" / "host-lane"), "run", "--timeout", str(timeout), "--", *command]
    start = time.monotonic()
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                            timeout=timeout + 120, stdin=subprocess.DEVNULL,
                            env={**os.environ, "OOMGUARD_IN_HOST_LANE": "1"})
    if result.returncode in skip_codes:
        output = result.stdout + result.stderr
        reason = next((line for line in output.splitlines() if "SKIP" in line), output[-300:])
        pytest.skip(f"host lane unavailable: {reason}")
    return result, time.monotonic() - start


def lane_values(stdout: str) -> dict[str, str]:
    """The `key=value` lines a lane command printed (the last value of a key wins)."""
    values: dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and " " not in key:
            values[key] = value.strip()
    return values
