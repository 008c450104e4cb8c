"""The service for real (issue 27, items 3 and 6), in the workstation host lane: Debian bookworm,
systemd as PID 1 on cgroup v2, oomguard from its package (scripts/host-lane). One boot:

- `systemctl enable --now oomguard` with a glob rule over a slice's services: Type=notify
  readiness, STATUS= naming what is guarded;
- a service's growing job is checkpointed, not killed; the journal's MESSAGE is a line for
  people (no JSON), its fields select (`journalctl OOMGUARD_EVENT=checkpoint.done`);
- `systemctl reload` with a bad config keeps the daemon and its rules, the journal says why;
- the daemon stopped with SIGSTOP while a victim is frozen is SIGKILLed by the watchdog and
  restarted, and the victim is thawed or dumped, never left stopped;
- `oomguard status` after that restart shows the checkpoint taken before it;
- `systemctl stop` puts back every setting the guard changed (memory.high).
Skipped, with the lane's reason, only where the lane cannot run (exit 77)."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.host_lane import lane_values, run_host_lane

SERVICE = r"""
set -u
# sh is dash here, whose echo reads backslashes: text from the journal goes through printf.
systemctl is-system-running --wait >/dev/null
cat > /etc/oomguard/oomguard.toml <<'EOF'
[daemon]
rescan_interval = "1s"
# The lane's disk is small (1.9 GiB): the default budget, 10% of it, is one ~180 MiB
# checkpoint, and a job frozen a few MiB later than usual was refused (a flaky test).
store_max_size = "50%"

[[guard]]
cgroups = ["/sys/fs/cgroup/lane.slice/*.service"]
threshold = "70%"
EOF
# A job that grows 4 MiB every 0.1 s (written, so resident), as a service of lane.slice.
# Its output is not the journal: CRIU cannot dump a journal stream socket.
grow() {
  systemd-run --quiet --unit="$1" --slice=lane.slice -p MemoryMax=256M \
    -p StandardOutput=null -p StandardError=null python3 -c '
import time
held = []
while True:
    held.append(b"x" * (4 << 20))
    time.sleep(0.1)
'
  for i in $(seq 100); do
    p=$(systemctl show -p MainPID --value "$1.service"); [ "$p" != 0 ] && break; sleep 0.1
  done
  echo "$p"
}
journal() { journalctl -q -b -u oomguard.service "$@"; }
events() { journal OOMGUARD_EVENT="$1" -o cat | wc -l; }
mainpid() { systemctl show -p MainPID --value oomguard.service; }
state() { cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null; }
# A guarded cgroup before the guard: memory.high as systemd set it.
systemd-run --quiet --unit=idle --slice=lane.slice -p MemoryMax=256M -p StandardOutput=null \
  sleep 100000
idle=/sys/fs/cgroup/lane.slice/idle.service
echo "high_before=$(cat $idle/memory.high)"
systemctl enable --now oomguard.service || { journalctl -b -u oomguard --no-pager | tail -n 30; exit 11; }
echo "status_text=$(systemctl show -p StatusText --value oomguard.service)"
echo "high_guarded=$(cat $idle/memory.high)"
first_pid=$(mainpid)

# 1. A growing job is checkpointed, not killed; the journal as people and machines read it.
job=$(grow grow1)
for i in $(seq 600); do [ "$(events checkpoint.done)" -ge 1 ] && break; sleep 0.2; done
echo "job_after=$(kill -0 "$job" 2>/dev/null && echo alive || echo gone)"
echo "grow1_result=$(systemctl show -p Result --value grow1.service)"
journal OOMGUARD_EVENT=checkpoint.done -o json | head -n 1 > /tmp/done.json
printf 'done_json=%s\n' "$(cat /tmp/done.json)"
echo "json_messages=$(journal -o cat | grep -c '^[<{]')"
echo "messages=$(journal -o cat | wc -l)"
printf 'sample_message=%s\n' "$(journal OOMGUARD_EVENT=checkpoint.done -o cat | head -n 1)"

# 2. A reload with a bad config keeps the daemon and its rules; the journal says why.
cp /etc/oomguard/oomguard.toml /tmp/good.toml
printf 'threshold = \n' >> /etc/oomguard/oomguard.toml
systemctl reload oomguard.service; echo "reload_rc=$?"
for i in $(seq 100); do [ "$(events config.rejected)" -ge 1 ] && break; sleep 0.2; done
echo "after_reload=$(systemctl is-active oomguard.service) $(mainpid)"
printf 'rejected=%s\n' "$(journal OOMGUARD_EVENT=config.rejected -o cat | head -n 1)"
cp /tmp/good.toml /etc/oomguard/oomguard.toml

# 3. Hung with SIGSTOP while its victim is frozen: the watchdog restarts it, and the victim
#    is thawed or dumped, never left stopped.
frozen_before=$(events victim.frozen)
job2=$(grow grow2)
for i in $(seq 1500); do [ "$(events victim.frozen)" -gt "$frozen_before" ] && break; sleep 0.05; done
kill -STOP "$first_pid"; stopped_at=$(date +%s)
echo "stopped_state_job2=$(state "$job2")"
for i in $(seq 900); do
  now=$(mainpid)
  [ "$now" != 0 ] && [ "$now" != "$first_pid" ] \
    && [ "$(systemctl is-active oomguard.service)" = active ] && break
  sleep 0.2
done
echo "restarted_after_s=$(( $(date +%s) - stopped_at ))"
renewed=$([ "$now" != "$first_pid" ] && echo new || echo same)
echo "after_watchdog=$(systemctl is-active oomguard.service) $renewed"
echo "watchdog_said=$(journal -o cat | grep -c -i 'watchdog timeout')"
sleep 5
if kill -0 "$job2" 2>/dev/null; then
  echo "job2=alive $(state "$job2")"
else
  echo "job2=gone $(oomguard list --json | python3 -c "import json, sys
print(sum(1 for c in json.load(sys.stdin) if c['pid'] == $job2 and c['state'] == 'checkpointed'))")"
fi
# Whatever it is now, nothing in the slice is stopped.
echo "stopped_in_slice=$(for p in $(cat /sys/fs/cgroup/lane.slice/*/cgroup.procs); do
  state "$p"; done | grep -c T)"
# The new daemon's status still shows the first job's checkpoint (the history is in the store).
echo "status_history=$(oomguard status --json | python3 -c "import json, sys
print(sum(1 for e in json.load(sys.stdin).get('recent_events', [])
          if e.get('event') == 'checkpoint.done' and str(e.get('pid')) == '$job'))")"

# Were a checkpoint refused (the store's budget), each refusal is followed by a longer wait,
# not by the next freeze at once (test_v2_only's backoff test refuses every one).
echo "refusals=$(events checkpoint.refused) $(events action.backoff)"

# 4. Stopping the service puts back what it changed.
systemctl stop grow2.service 2>/dev/null
systemctl stop oomguard.service
echo "high_after_stop=$(cat $idle/memory.high)"
echo "stopped=$(systemctl is-active oomguard.service)"
"""


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_service_under_systemd(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_HOST_LANE") or os.environ.get("OOMGUARD_HOST_LANE"):
        pytest.skip("already inside the host lane")
    result, wall = run_host_lane(["sh", "-c", SERVICE], 720)
    output = result.stdout + result.stderr
    got = lane_values(result.stdout)
    with capsys.disabled():
        print(f"\n[host lane] {wall:.0f} s wall, exit {result.returncode}; watchdog restart "
              f"after {got.get('restarted_after_s')} s")
    assert result.returncode == 0, output[-6000:]
    # Type=notify (enable --now returned once READY=1 came) and STATUS= names the rule's match.
    assert got.get("status_text", "").startswith(
        "guarding 1 of 1 cgroup(s): /sys/fs/cgroup/lane.slice/idle.service;"), got
    # 1. Checkpointed, not killed (the unit ended as the dump ended it: no oom-kill result).
    assert got.get("job_after") == "gone", output[-4000:]
    assert got.get("grow1_result") != "oom-kill", got
    done = json.loads(got["done_json"])
    assert done["OOMGUARD_EVENT"] == "checkpoint.done"
    assert done["SYSLOG_IDENTIFIER"] == "oomguard"
    assert re.fullmatch(r"[0-9a-f-]+|\d{8}-\d{6}-\d+-[0-9a-f]+", done["CHECKPOINT_ID"]), done
    assert done["OOMGUARD_CGROUP"].endswith("/lane.slice/grow1.service"), done
    assert done["OOMGUARD_PID"].isdigit(), done
    assert done["_SYSTEMD_UNIT"] == "oomguard.service"
    assert done["MESSAGE"].startswith("checkpoint.done: cgroup="), done["MESSAGE"]
    assert "{" not in done["MESSAGE"] and "\n" not in done["MESSAGE"]
    assert got.get("json_messages") == "0", output[-4000:]
    assert int(got.get("messages", "0")) > 5
    # 2. A bad reload: still the same daemon, and the journal names the file and the problem.
    assert got.get("reload_rc") == "0"
    assert got.get("after_reload", "").startswith("active "), got
    assert "/etc/oomguard/oomguard.toml" in got.get("rejected", ""), got
    # 3. The watchdog: restarted (WatchdogSec 30 s, TimeoutAbortSec 10 s), the victim not stopped.
    assert got.get("after_watchdog") == "active new", output[-5000:]
    assert int(got.get("restarted_after_s", "999")) <= 120, got
    job2 = got.get("job2", "")
    assert job2 in ("gone 1",) or (job2.startswith("alive") and not job2.endswith("T")), \
        output[-5000:]
    assert got.get("stopped_in_slice") == "0", output[-5000:]
    assert got.get("status_history", "0") != "0", output[-5000:]  # from before the restart
    # Refused checkpoints, if any: each try waited for (two daemons: at most one try each in
    # flight), never the freeze-refuse-thaw loop of ten a second.
    refusals, backoffs = (int(n) for n in got.get("refusals", "-1 -1").split())
    assert 0 <= refusals <= backoffs + 2, got.get("refusals")
    # 4. Stopped: memory.high is systemd's again.
    assert got.get("high_guarded") != got.get("high_before"), got
    assert got.get("high_after_stop") == got.get("high_before"), got
    assert got.get("stopped") == "inactive"
