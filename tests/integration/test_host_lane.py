"""The workstation host lane's smoke test (issue 27, items 1-2): a real Debian bookworm with
systemd as PID 1 on cgroup v2 (scripts/host-lane), oomguard installed there with `apt install`
of the package built from this checkout (scripts/package). The package enables nothing (the
default config guards nothing); `systemctl enable --now oomguard` brings the service up, Type=
notify, saying that it guards nothing; the packaged daemon checkpoints a service's process
(`oomguard checkpoint`) and restores it; purging the package removes its units and config and
leaves the store. Skipped, with the lane's reason, only where the lane cannot run (exit 77)."""

from __future__ import annotations

import os
import re

import pytest

from tests.host_lane import lane_values, run_host_lane

# One boot: ~22 s to multi-user.target, the package install, the service start, a purge.
SMOKE = r"""
set -u
echo "system=$(systemctl is-system-running --wait)"
echo "pid1=$(cat /proc/1/comm)"
echo "cgroupfs=$(stat -fc %T /sys/fs/cgroup)"
echo "installed=$(dpkg-query -W -f='${Status} ${Version}' oomguard)"
echo "enabled_after_install=$(systemctl is-enabled oomguard.service)"
echo "active_after_install=$(systemctl is-active oomguard.service)"
echo "config_guards=$(grep -c '^\[\[guard\]\]' /etc/oomguard/oomguard.toml)"
systemctl enable --now oomguard.service || { journalctl -b -u oomguard --no-pager | tail -n 30; exit 11; }
echo "active=$(systemctl is-active oomguard.service)"
echo "status_text=$(systemctl show -p StatusText --value oomguard.service)"
echo "control_group=$(systemctl show -p ControlGroup --value oomguard.service)"
pid=$(systemctl show -p MainPID --value oomguard.service)
echo "daemon_cgroup=$(cut -d: -f3 /proc/$pid/cgroup)"
oomguard status || exit 12
echo "criu=$(criu --version | sed -n 's/^Version: *//p')"
# The packaged daemon does its job under systemd: a service's process is checkpointed and
# restored. (Its stdout is not the journal: CRIU cannot dump a journal stream socket yet.)
systemd-run --quiet --unit=lane-job -p MemoryMax=256M -p StandardOutput=null \
  -p StandardError=null sleep 100000
job=0
for i in $(seq 50); do
  job=$(systemctl show -p MainPID --value lane-job.service); [ "$job" != 0 ] && break; sleep 0.2
done
echo "job_cgroup=$(cut -d: -f3 /proc/$job/cgroup)"
oomguard checkpoint "$job" >/tmp/checkpoint.out 2>&1; echo "checkpoint_rc=$?"
[ -s /tmp/checkpoint.out ] && sed 's/^/checkpoint_said: /' /tmp/checkpoint.out >&2
echo "job_after_checkpoint=$(kill -0 "$job" 2>/dev/null && echo alive || echo gone)"
first() { oomguard list --json | python3 -c "import json,sys; c=json.load(sys.stdin)[0]; print($1)"; }
echo "checkpoint=$(first 'c["state"], c["cgroup"]')"
oomguard restore "$(first 'c["id"]')" >/dev/null 2>&1; echo "restore_rc=$?"
new=$(first 'c["restored_pid"]')
echo "restored=$(first 'c["state"]') $(kill -0 "$new" 2>/dev/null && echo alive || echo gone)"
echo "restored_cgroup=$(cut -d: -f3 /proc/$new/cgroup)"
echo "restored_unit=$(systemctl is-active "$(basename "$(cut -d: -f3 /proc/$new/cgroup)")")"
# The unit's sandbox: the daemon in a mount namespace of its own, /usr read-only there; CRIU
# restored the job into the host's, unconfined (no seccomp, no no_new_privs, every capability).
ns() { readlink "/proc/$1/ns/mnt"; }
echo "daemon_ns=$([ "$(ns "$pid")" != "$(ns 1)" ] && echo own || echo host)"
nsenter -t "$pid" -m touch /usr/lane-probe 2>/dev/null && echo "daemon_usr=rw" || echo "daemon_usr=ro"
echo "restored_ns=$([ "$(ns "$new")" = "$(ns 1)" ] && echo host || echo other)"
field() { sed -n "s/^$2:[[:space:]]*//p" "/proc/$1/status"; }
bounding=$([ "$(field "$new" CapBnd)" = "$(field 1 CapBnd)" ] && echo full || echo less)
echo "restored_confinement=$(field "$new" NoNewPrivs) $(field "$new" Seccomp) $bounding"
man -w oomguard >/dev/null 2>&1 || test -e /usr/share/man/man8/oomguard.8.gz && echo "man=yes"
touch /var/lib/oomguard/.made-before-purge
apt-get purge -y -q oomguard >/dev/null 2>&1 || exit 13
echo "purge_unit=$(test -e /lib/systemd/system/oomguard.service && echo present || echo gone)"
wants=/etc/systemd/system/multi-user.target.wants
echo "purge_link=$(test -e $wants/oomguard.service && echo present || echo gone)"
echo "purge_config=$(test -e /etc/oomguard && echo present || echo gone)"
echo "purge_store=$(test -e /var/lib/oomguard/.made-before-purge && echo kept || echo gone)"
echo "purge_active=$(systemctl is-active oomguard.service)"
"""


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_systemd_host_runs_the_packaged_service(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_HOST_LANE") or os.environ.get("OOMGUARD_HOST_LANE"):
        pytest.skip("already inside the host lane")
    result, wall = run_host_lane(["sh", "-c", SMOKE], 420)
    output = result.stdout + result.stderr
    with capsys.disabled():
        boot = re.search(r"\[host-lane\] VM wall time .*", output)
        print(f"\n[host lane] {wall:.0f} s wall, exit {result.returncode}; "
              f"{boot.group(0) if boot else ''}; restored into "
              f"{lane_values(result.stdout).get('restored_cgroup')}")
    assert result.returncode == 0, output[-6000:]
    got = lane_values(result.stdout)
    # The host: systemd as PID 1, the unified hierarchy, booted all the way.
    assert got.get("system") == "running", output[-4000:]
    assert got.get("pid1") == "systemd"
    assert got.get("cgroupfs") == "cgroup2fs"
    assert got.get("criu", "").startswith("4.2"), output[-3000:]
    # The package: installed by apt, enables nothing, ships a config that guards nothing.
    assert got.get("installed", "").startswith("install ok installed"), output[-3000:]
    assert got.get("enabled_after_install") == "disabled"
    assert got.get("active_after_install") == "inactive"
    assert got.get("config_guards") == "0"
    assert got.get("man") == "yes"
    # The service, once enabled: up (Type=notify: `enable --now` returned after READY=1), in
    # its own cgroup under system.slice, and saying that it guards nothing.
    assert got.get("active") == "active"
    assert got.get("status_text", "").startswith("guarding 0 of 0 cgroup(s)"), got
    assert got.get("control_group") == "/system.slice/oomguard.service"
    assert got.get("daemon_cgroup") == "/system.slice/oomguard.service"
    assert "daemon: running" in result.stdout
    assert "no [[guard]] rules" in result.stdout
    # The packaged daemon checkpoints a service's process and restores it: into a new scope
    # of its own in the service's slice, which systemd knows about (the service is gone).
    assert got.get("job_cgroup") == "/system.slice/lane-job.service", output[-3000:]
    assert got.get("checkpoint_rc") == "0", output[-3000:]
    assert got.get("job_after_checkpoint") == "gone"
    assert got.get("checkpoint") == "checkpointed /system.slice/lane-job.service"
    assert got.get("restore_rc") == "0", output[-3000:]
    assert got.get("restored") == "restored alive", output[-3000:]
    assert re.fullmatch(r"/system\.slice/oomguard-restore-[\w-]+\.scope",
                        got.get("restored_cgroup", "")), output[-3000:]
    assert got.get("restored_unit") == "active", output[-3000:]
    # Hardened (ProtectSystem=full), yet CRIU restored into the host's namespace, unconfined.
    assert got.get("daemon_ns") == "own" and got.get("daemon_usr") == "ro", got
    assert got.get("restored_ns") == "host", got
    assert got.get("restored_confinement") == "0 0 full", got
    # Purge: the units, their enablement and the config go; the store stays; nothing runs.
    assert got.get("purge_unit") == "gone"
    assert got.get("purge_link") == "gone"
    assert got.get("purge_config") == "gone"
    assert got.get("purge_store") == "kept"
    assert got.get("purge_active") == "inactive"
