"""A user's session on the workstation host (issue 27, item 4), in the host lane: Debian bookworm,
systemd as PID 1 on cgroup v2, oomguard from its package. One boot:

- a real user (useradd) with their own `systemd --user` (linger) and session bus
  (dbus-user-session); a test receiver owns org.freedesktop.Notifications on that bus, and
  the packaged notification agent runs as their user unit;
- their job runs in `systemd-run --user --scope -p MemoryMax=256M`, under
  user@UID.service/app.slice, guarded by a glob rule over users' app slices, and is
  checkpointed, not killed;
- the agent puts a notification for it on their session bus;
- they list their checkpoints through the socket and see only theirs (root has one too);
- they restore theirs, and it lands in a new scope their systemd knows about
  (oomguard-restore-ID.scope in app.slice, active), not in a stray cgroup.
Skipped, with the lane's reason, only where the lane cannot run (exit 77)."""

from __future__ import annotations

import os

import pytest

from tests.host_lane import lane_values, run_host_lane

USER = r"""
set -u
# sh is dash here, whose echo reads backslashes: free text goes through printf.
systemctl is-system-running --wait >/dev/null
useradd -m -u 1500 -s /bin/bash lane
uid=1500
loginctl enable-linger lane
for i in $(seq 300); do
  [ -S /run/user/$uid/bus ] && [ "$(systemctl is-active user@$uid.service)" = active ] && break
  sleep 0.2
done
echo "user_manager=$(systemctl is-active user@$uid.service)"
asuser() {
  setpriv --reuid=$uid --regid=$uid --init-groups env -i HOME=/home/lane USER=lane \
    PATH=/usr/bin:/bin XDG_RUNTIME_DIR=/run/user/$uid \
    DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/$uid/bus "$@"
}
# A desktop's notification server, as far as the agent can tell: owns the name, takes Notify.
cat > /tmp/receiver.py <<'EOF'
import sys
from jeepney import HeaderFields, MessageType, new_error, new_method_return
from jeepney.bus_messages import message_bus
from jeepney.io.blocking import open_dbus_connection
conn = open_dbus_connection(bus="SESSION")
conn.send_and_get_reply(message_bus.RequestName("org.freedesktop.Notifications", 4))
out = open(sys.argv[1], "a", buffering=1)
out.write("ready\n")
count = 0
while True:
    msg = conn.receive()
    if msg.header.message_type != MessageType.method_call:
        continue
    member = msg.header.fields.get(HeaderFields.member)
    if member == "Notify":
        count += 1
        out.write(f"notify {msg.body[3]} | {msg.body[4]}\n".replace("\n", " ").rstrip() + "\n")
        conn.send(new_method_return(msg, "u", (count,)))
    elif member == "GetCapabilities":
        conn.send(new_method_return(msg, "as", (["body"],)))
    elif member == "GetServerInformation":
        conn.send(new_method_return(msg, "ssss", ("lane", "test", "1", "1.2")))
    else:
        conn.send(new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod", "s", (member,)))
EOF
touch /tmp/notes.txt && chown lane /tmp/notes.txt
asuser /usr/lib/oomguard/bin/python -I /tmp/receiver.py /tmp/notes.txt &
for i in $(seq 100); do grep -q ready /tmp/notes.txt && break; sleep 0.1; done
echo "receiver=$(grep -c ready /tmp/notes.txt)"
asuser systemctl --user start oomguard-notify-agent.service
echo "agent=$(asuser systemctl --user is-active oomguard-notify-agent.service)"
cat > /etc/oomguard/oomguard.toml <<'EOF'
[daemon]
rescan_interval = "1s"
# The lane's disk is small (1.9 GiB): the default budget, 10% of it, is one ~180 MiB
# checkpoint, and a job frozen a few MiB later than usual was refused (a flaky test).
store_max_size = "50%"

[[guard]]
cgroups = ["/sys/fs/cgroup/user.slice/user-*.slice/user@*.service/app.slice/*.scope"]
threshold = "70%"
EOF
systemctl enable --now oomguard.service || { journalctl -b -u oomguard --no-pager | tail -n 30; exit 11; }
# Root's own checkpoint, which the user must not see.
systemd-run --quiet --unit=rootjob -p StandardOutput=null -p StandardError=null sleep 100000
for i in $(seq 50); do
  rootjob=$(systemctl show -p MainPID --value rootjob.service); [ "$rootjob" != 0 ] && break; sleep 0.1
done
oomguard checkpoint "$rootjob" >/dev/null 2>&1; echo "root_checkpoint_rc=$?"
# The user's job: a scope of their own manager, with a limit; it grows 4 MiB every 0.1 s to
# 400 MiB and holds it.
scope=/sys/fs/cgroup/user.slice/user-$uid.slice/user@$uid.service/app.slice/job1.scope
asuser systemd-run --user --scope --quiet --unit=job1 -p MemoryMax=256M python3 -c '
import time
held = []
while True:
    if len(held) < 100:
        held.append(b"x" * (4 << 20))
    time.sleep(0.1)
' >/dev/null 2>&1 &
for i in $(seq 100); do
  job=$(head -n 1 $scope/cgroup.procs 2>/dev/null); [ -n "$job" ] && break; sleep 0.1
done
echo "job_uid=$(stat -c %u /proc/$job)"
# Their job's checkpoint, not root's (taken above, also checkpoint.done).
done_events() {
  journalctl -q -b -u oomguard.service OOMGUARD_EVENT=checkpoint.done OOMGUARD_PID="$job" "$@"
}
for i in $(seq 600); do [ "$(done_events -o cat | wc -l)" -ge 1 ] && break; sleep 0.2; done
echo "job_after=$(kill -0 "$job" 2>/dev/null && echo alive || echo gone)"
echo "done_pid=$(done_events -o json | python3 -c "import json, sys
print(json.loads(sys.stdin.readline())['OOMGUARD_PID'])")"
for i in $(seq 100); do grep -q '^notify' /tmp/notes.txt && break; sleep 0.2; done
printf 'notification=%s\n' "$(grep '^notify' /tmp/notes.txt | head -n 1)"
# What the user sees: their checkpoint only.
asuser oomguard list --json > /tmp/mine.json; echo "list_rc=$?"
echo "listed=$(python3 -c "import json
mine = json.load(open('/tmp/mine.json'))
print(len(mine), sorted({c['uid'] for c in mine}), mine[0]['pid'] if mine else '-')")"
id=$(python3 -c "import json; print(json.load(open('/tmp/mine.json'))[0]['id'])")
asuser oomguard show "$(oomguard list --json | python3 -c "import json, sys
print(next(c['id'] for c in json.load(sys.stdin) if c['uid'] == 0))")" >/dev/null 2>&1
echo "show_roots_rc=$?"
# They bring theirs back: into a scope their systemd knows about.
new=$(asuser oomguard restore "$id" 2>/tmp/restore.err); rc=$?
printf 'restore_rc=%s %s\n' "$rc" "$(tail -n 1 /tmp/restore.err)"
echo "restored_cgroup=$(cut -d: -f3 /proc/$new/cgroup 2>/dev/null)"
echo "restored_uid=$(stat -c %u /proc/$new 2>/dev/null)"
echo "restored_scope=$(asuser systemctl --user is-active "oomguard-restore-$id.scope")"
sleep 2
echo "restored_alive=$(kill -0 "$new" 2>/dev/null && echo yes || echo no)"
kill -9 "$new" 2>/dev/null
"""


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_users_job_in_their_own_scope(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("OOMGUARD_IN_HOST_LANE") or os.environ.get("OOMGUARD_HOST_LANE"):
        pytest.skip("already inside the host lane")
    result, wall = run_host_lane(["sh", "-c", USER], 720)
    output = result.stdout + result.stderr
    got = lane_values(result.stdout)
    with capsys.disabled():
        print(f"\n[host lane] {wall:.0f} s wall, exit {result.returncode}; restored into "
              f"{got.get('restored_cgroup')}")
    assert result.returncode == 0, output[-6000:]
    assert got.get("user_manager") == "active", output[-4000:]
    assert got.get("receiver") == "1" and got.get("agent") == "active", output[-4000:]
    assert got.get("root_checkpoint_rc") == "0", output[-4000:]
    # Their job, in their scope, was checkpointed and not killed.
    assert got.get("job_uid") == "1500", output[-4000:]
    assert got.get("job_after") == "gone", output[-4000:]
    # The agent told their desktop.
    assert got.get("notification", "").startswith("notify Checkpointed to save memory"), \
        output[-4000:]
    # They see their checkpoint and no one else's; root's is not theirs to show.
    assert got.get("list_rc") == "0"
    assert got.get("listed", "").startswith("1 [1500] "), got.get("listed")
    assert got.get("listed", "").endswith(got.get("done_pid", "?")), got
    assert got.get("show_roots_rc") not in ("0", None), got
    # Restored by them, into a scope of their own manager's that systemd knows about.
    assert got.get("restore_rc", "").startswith("0"), output[-4000:]
    restored = got.get("restored_cgroup", "")
    assert restored.startswith("/user.slice/user-1500.slice/user@1500.service/app.slice/"
                               "oomguard-restore-"), output[-4000:]
    assert restored.endswith(".scope")
    assert got.get("restored_uid") == "1500"
    assert got.get("restored_scope") == "active", output[-4000:]
    assert got.get("restored_alive") == "yes"
