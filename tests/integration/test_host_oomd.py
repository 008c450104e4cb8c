"""systemd-oomd beside oomguard (issue 27, item 5), in the workstation host lane: Debian
bookworm, systemd as PID 1 on cgroup v2, Debian's systemd-oomd, oomguard from its package.

A slice with ManagedOOMMemoryPressure=kill holds a job that grows past its MemoryHigh=, where
the kernel throttles it (memory pressure, as a workstation thrashing). Without oomguard,
systemd-oomd kills the job. With oomguard guarding the slice's services below MemoryHigh=,
the job is checkpointed first and systemd-oomd kills nothing. (bookworm's systemd 252 has no
pre-kill hook: `oomd_prekill_dir` needs systemd >= 260, tested against a fake oomd elsewhere.)
Skipped, with the lane's reason, only where the lane cannot run (exit 77)."""

from __future__ import annotations

import os

import pytest

from tests.host_lane import lane_values, run_host_lane

OOMD = r"""
set -u
systemctl is-system-running --wait >/dev/null
mkdir -p /etc/systemd/oomd.conf.d
printf '[OOM]\nDefaultMemoryPressureDurationSec=5s\n' > /etc/systemd/oomd.conf.d/lane.conf
cat > /etc/systemd/system/oomlane.slice <<'EOF'
[Slice]
ManagedOOMMemoryPressure=kill
ManagedOOMMemoryPressureLimit=40%
EOF
systemctl daemon-reload
systemctl enable --now systemd-oomd.service >/dev/null 2>&1
systemctl restart systemd-oomd.service
echo "oomd=$(systemctl is-active systemd-oomd.service)"
oomd_kills() { journalctl -q -b -u systemd-oomd.service -o cat | grep -c 'Killed'; }
# A job that grows 4 MiB every 0.1 s up to 400 MiB, then holds it, in oomlane.slice, under
# MemoryHigh=160M (throttled there: memory pressure) and MemoryMax=512M.
grow() {
  systemd-run --quiet --unit="$1" --slice=oomlane.slice -p MemoryHigh=160M -p MemoryMax=512M \
    -p StandardOutput=null -p StandardError=null python3 -c '
import time
held = []
while True:
    if len(held) < 100:
        held.append(b"x" * (4 << 20))
    time.sleep(0.1)
'
  for i in $(seq 100); do
    p=$(systemctl show -p MainPID --value "$1.service"); [ "$p" != 0 ] && break; sleep 0.1
  done
  echo "$p"
}
ended() {  # waits up to $2 s for unit $1 to end; prints how long it took
  for i in $(seq $(( $2 * 5 ))); do
    [ "$(systemctl is-active "$1.service")" != active ] && { echo $(( i / 5 )); return; }
    sleep 0.2
  done
  echo never
}

# 1. Without oomguard: systemd-oomd kills the job.
before=$(oomd_kills)
job=$(grow alone)
echo "alone_ended_after_s=$(ended alone 240)"
echo "alone_oomd_kills=$(( $(oomd_kills) - before ))"
echo "alone_result=$(systemctl show -p Result --value alone.service)"
journalctl -q -b -u systemd-oomd.service -o cat | grep Killed | tail -n 2
systemctl reset-failed alone.service 2>/dev/null

# 2. With oomguard guarding the slice's services at 25% of MemoryMax (128 MiB, under
#    MemoryHigh): checkpointed, and systemd-oomd kills nothing.
cat > /etc/oomguard/oomguard.toml <<'EOF'
[daemon]
rescan_interval = "1s"

[[guard]]
cgroups = ["/sys/fs/cgroup/oomlane.slice/*.service"]
threshold = "25%"
EOF
systemctl enable --now oomguard.service || { journalctl -b -u oomguard --no-pager | tail -n 30; exit 11; }
before=$(oomd_kills)
job=$(grow guarded)
echo "guarded_ended_after_s=$(ended guarded 240)"
sleep 10  # systemd-oomd's window (5 s) and then some: a late kill would show
echo "guarded_oomd_kills=$(( $(oomd_kills) - before ))"
echo "guarded_checkpoints=$(oomguard list --json | python3 -c "import json, sys
print(sum(1 for c in json.load(sys.stdin) if c['pid'] == $job and c['state'] == 'checkpointed'))")"
echo "oomd_after=$(systemctl is-active systemd-oomd.service)"
"""


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_oomguard_checkpoints_before_systemd_oomd_kills(
        capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_HOST_LANE") or os.environ.get("OOMGUARD_HOST_LANE"):
        pytest.skip("already inside the host lane")
    result, wall = run_host_lane(["sh", "-c", OOMD], 720)
    output = result.stdout + result.stderr
    got = lane_values(result.stdout)
    with capsys.disabled():
        print(f"\n[host lane] {wall:.0f} s wall, exit {result.returncode}; alone: ended after "
              f"{got.get('alone_ended_after_s')} s, {got.get('alone_oomd_kills')} oomd kill(s); "
              f"guarded: ended after {got.get('guarded_ended_after_s')} s, "
              f"{got.get('guarded_oomd_kills')} oomd kill(s)")
    assert result.returncode == 0, output[-6000:]
    assert got.get("oomd") == "active", output[-4000:]
    # Without oomguard: systemd-oomd killed the job.
    assert got.get("alone_ended_after_s") != "never", output[-4000:]
    assert got.get("alone_oomd_kills", "0") != "0", output[-4000:]
    # With oomguard: the job was checkpointed, and systemd-oomd killed nothing.
    assert got.get("guarded_ended_after_s") != "never", output[-4000:]
    assert got.get("guarded_checkpoints") == "1", output[-4000:]
    assert got.get("guarded_oomd_kills") == "0", output[-4000:]
    assert got.get("oomd_after") == "active"
