#!/bin/bash
# Slurm end to end, inside the cgroup v2 VM lane (run by tests/integration/test_slurm_lane.py):
#   scripts/vm-lane run --timeout 1500 -- bash tests/vmlane_slurm.sh
# A single-node Slurm (Debian's slurm-wlm 22.05, munge; cgroup/v2 plugin with IgnoreSystemd)
# runs a batch job with --mem=128M whose program outgrows it. oomguard, guarding the job
# cgroups by glob, checkpoints it instead of letting the kernel kill it, writes the job's
# AdminComment and requeues it; the requeued run's batch script calls `oomguard resume-job`,
# which restores the checkpoint into the new allocation's cgroup, and the program finishes
# with every count in order and its memory intact.
set -euo pipefail
repo=$(pwd)
work=${OOMGUARD_VM_SCRATCH:?run inside scripts/vm-lane}/slurm
local_dir=/run/slurm-lane   # guest RAM: slurmd mmaps its spool files, which 9p cannot do
mkdir -p "$work"/{log,out}
mkdir -p "$local_dir"/{state,spool}
chmod 755 "$OOMGUARD_VM_SCRATCH" "$work" "$work/out"
host=$(hostname -s)
# The guest has loopback only; Slurm resolves with AI_ADDRCONFIG, which wants an address that
# is not a loopback one: give lo one.
ip link set lo up 2>/dev/null || true
ip addr add 10.200.0.1/32 dev lo 2>/dev/null || true
addr=10.200.0.1
say() { printf '[slurm-lane] %s\n' "$*" >&2; }
fail() { say "FAIL: $*"; for f in "$work"/log/*.log "$work"/out/* "$local_dir"/store/*/*.log \
    "$local_dir"/store/*/images/restore.log; do
  [ -f "$f" ] && { echo "== $f" >&2; tail -n 40 "$f" >&2; }; done
  echo "== dmesg (memory.stat lines left out)" >&2
  dmesg | grep -vE '^ +[a-z_]+ [0-9]+$' | tail -n 30 >&2
  say "FAIL: $* (again, after the logs: the end of the output is what a CI log keeps)"; exit 1; }

command -v slurmctld >/dev/null && command -v munged >/dev/null \
  || { say "SKIP: slurm-wlm or munge not installed (scripts/setup installs them)"; exit 3; }

# -- munge: a key of our own, root-owned, in the guest's RAM ---------------------------------
mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
dd if=/dev/urandom of=/etc/munge/og.key bs=1024 count=1 status=none
chmod 400 /etc/munge/og.key
munged --force --key-file=/etc/munge/og.key --socket=/run/munge/munge.socket.2 \
  --log-file="$work/log/munged.log" --pid-file=/run/munge/munged.pid --num-threads=2

# -- slurm.conf / cgroup.conf --------------------------------------------------------------
export SLURM_CONF=$work/slurm.conf
cat > "$SLURM_CONF" <<EOF
ClusterName=oomguard
SlurmctldHost=$host($addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$local_dir/state
SlurmdSpoolDir=$local_dir/spool
SlurmctldPidFile=$local_dir/slurmctld.pid
SlurmdPidFile=$local_dir/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobRequeue=1
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
NodeName=$host NodeAddr=$addr CPUs=2 RealMemory=1500 State=UNKNOWN
PartitionName=lane Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
cat > "$work/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v2
IgnoreSystemd=yes
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
AllowedRAMSpace=100
EOF

# slurmd (cgroup/v2, IgnoreSystemd) makes its scope under system.slice, which only systemd
# would have created: make it, with the controllers the job cgroups need.
mkdir -p /sys/fs/cgroup/system.slice
for c in memory pids cpu; do
  echo "+$c" > /sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null || true
done
slurmctld -i || fail "slurmctld did not start"
slurmd || fail "slurmd did not start"
for _ in $(seq 1 120); do
  sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed)' && break; sleep 1
done
sinfo -h -o %T | grep -qE '^(idle|mixed)' || fail "the node did not come up"
say "slurm is up: $(sinfo -h -o '%N %T %m')"

# -- oomguard: guard every job's cgroup, requeue a checkpointed job -------------------------
store=$local_dir/store      # guest RAM too: faster than 9p under emulation
sock=$local_dir/oomguard.sock  # a UNIX socket cannot live on 9p
cat > "$work/oomguard.toml" <<EOF
[daemon]
store = "$store"
socket = "$sock"
rescan_interval = "1s"
# The store is in the guest's RAM (a tmpfs of half of it): the default budget (10% of its file
# system) would refuse this job's checkpoint; this lane gives it most of the tmpfs.
store_max_size = "75%"
store_keep_free = "5%"

[slurm]
after_checkpoint = "requeue"
grow_memory = 2.0

[[guard]]
cgroups = ["/system.slice/*slurmstepd.scope/job_*"]
threshold = "80%"
EOF
"$repo/.venv/bin/python" -m oomguard --log-format json run --config "$work/oomguard.toml" \
  > "$work/log/oomguard.log" 2>&1 &
guard=$!
for _ in $(seq 1 60); do grep -q '"guard.started"' "$work/log/oomguard.log" && break; sleep 1; done
sleep 2  # it arms the guards after saying so: a daemon that died doing it fails here, not later
kill -0 "$guard" 2>/dev/null || fail "oomguard exited at start"

# -- the job: first run grows past --mem; the requeued run resumes it -----------------------
cat > "$work/job.sh" <<EOF
#!/bin/bash
if [ "\${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  exec "$repo/.venv/bin/python" -m oomguard --store "$store" --socket "$sock" \\
    --log-format json resume-job
fi
# A job sets up before it grows (3 s here): the guard finds new job cgroups by its 1 s rescan,
# which under software emulation on a loaded machine can take a few seconds; a job that fills
# its 128 MiB before it is guarded is the kernel's, not oomguard's (a CI run lost one so).
sleep 3
exec "$repo/.venv/bin/python" "$repo/tests/workloads/hog.py" --log "$work/out/hog.log" \
  --target 160 --rate 20 --count 400 --tick 0.02
EOF
chmod 755 "$work/job.sh"
job=$(sbatch --parsable --mem=128M --requeue -o "$work/out/job-%j.out" "$work/job.sh") \
  || fail "sbatch failed"
say "submitted job $job"

for _ in $(seq 1 900); do
  grep -q "^done " "$work/out/hog.log" 2>/dev/null && break
  # One look at the job for both: a finished first run seen by one call and the requeue by
  # the next would look like a finished second run.
  info=$(scontrol show job "$job" 2>/dev/null || true)
  if echo "$info" | grep -q "JobState=\(COMPLETED\|FAILED\|OUT_OF_MEMORY\|CANCELLED\)"; then
    echo "$info" | grep -q "Restarts=[1-9]" && { sleep 5; break; }
    ended=$((${ended:-0} + 1))  # the first run ended and no requeue came: not for ever
    [ "$ended" -ge 30 ] && break
  else
    ended=0
  fi
  sleep 1
done
grep -q '"checkpoint.done"' "$work/log/oomguard.log" || fail "no checkpoint"
grep -q '"slurm.notified"' "$work/log/oomguard.log" || fail "Slurm was not told"
comment=$(scontrol show job "$job" | grep -o 'AdminComment=[^ ]*.*' | head -n1 || true)
restarts=$(scontrol show job "$job" | grep -o 'Restarts=[0-9]*' | head -n1 || true)
say "$comment"
say "$restarts"
echo "$comment" | grep -q "checkpointed instead of OOM-killed" || fail "no AdminComment"
grep -q "^done 400 ok" "$work/out/hog.log" || fail "the resumed job did not finish intact"
counts=$(grep -E '^[0-9]+ ' "$work/out/hog.log" | cut -d' ' -f1 | tr '\n' ' ')
expected=$(seq -s ' ' 1 400)
[ "$counts" = "$expected " ] || fail "counts out of order or missing"
oom=$(cat /sys/fs/cgroup/system.slice/*slurmstepd.scope/memory.events 2>/dev/null \
  | awk '/^oom_kill /{print $2}')
say "oom_kill in slurmstepd.scope: ${oom:-?}"
kill "$guard" 2>/dev/null || true
say "PASS: job $job checkpointed instead of OOM-killed, requeued ($restarts), resumed, done 400 ok"
