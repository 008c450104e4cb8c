#!/bin/bash
# One node of scripts/cluster-lane, inside a VM of the v2 lane: `bash tests/clusterlane_node.sh a|b`.
# Node A (10.91.0.1): NFS server of the shared store, slurmctld, slurmd, oomguard, and the
# scenario's driver. Node B (10.91.0.2): slurmd and oomguard; it waits for A to finish.
# $OOMGUARD_CLUSTER_DIR is a host directory both VMs share (9p): the munge key, the Slurm
# configuration, the logs, the handshakes and the result line. $OOMGUARD_CLUSTER_MEM_MIB (the
# job's --mem), _GROW (grow_memory), _REAL_A and _REAL_B (the nodes' RealMemory) come from
# scripts/cluster-lane; with $OOMGUARD_CLUSTER_BENCH=1 the nodes also measure the shared
# store's write and read rates after the scenario (bench/crossnode.py).
set -euo pipefail
role=${1:?a or b}
dir=${OOMGUARD_CLUSTER_DIR:?run by scripts/cluster-lane}
scratch=${OOMGUARD_VM_SCRATCH:?run inside scripts/vm-lane}
repo=$(pwd)
py=$repo/.venv/bin/python
local_dir=/run/cluster-lane
# The guest's root is the host's, read-only: the shared file system is mounted under a tmpfs
# on /mnt, at the same path on both nodes.
mountpoint -q /mnt || mount -t tmpfs -o mode=755 mnt /mnt
shared=/mnt/shared
mkdir -p "$local_dir"/{state,spool} "$shared"
me=node$role
mem=${OOMGUARD_CLUSTER_MEM_MIB:-256}
grow=${OOMGUARD_CLUSTER_GROW:-3.0}
real_a=${OOMGUARD_CLUSTER_REAL_A:-600}
real_b=${OOMGUARD_CLUSTER_REAL_B:-1200}
bench=${OOMGUARD_CLUSTER_BENCH:-0}
if [ "$role" = a ]; then addr=10.91.0.1; peer=10.91.0.2; else addr=10.91.0.2; peer=10.91.0.1; fi
say() { printf '[cluster-lane %s] %s\n' "$me" "$*" >&2; }
fail() {
  say "FAIL: $*"
  [ "$role" = a ] && echo "FAIL: $*" > "$dir/result"
  touch "$dir/finished.$role"
  for f in "$dir"/log/*-"$me".log $shared/out/*; do
    [ -f "$f" ] && { echo "== $f" >&2; tail -n 30 "$f" >&2; }
  done
  exit 1
}
wait_file() {  # wait_file PATH SECS
  local i
  for i in $(seq 1 "$2"); do [ -e "$1" ] && return 0; sleep 1; done
  return 1
}

# -- the clock: the host's, so that one node's events can be set against the other's ----------
# A file created on the 9p share gets the host's time; the node's own time written into a
# second one says how close it came (scripts/cluster-lane compares the two).
: > "$dir/clock-set.$role"
date -s "@$(stat -c %.9Y "$dir/clock-set.$role")" >/dev/null || true
date +%s.%N > "$dir/clock-check.$role"

# -- the link: one Ethernet segment between the two VMs, nothing else --------------------------
modprobe virtio_net 2>/dev/null || true
ip link set lo up
nic=""
for _ in $(seq 1 50); do
  nic=$(ls /sys/class/net | grep -v '^lo$' | head -n1 || true)
  [ -n "$nic" ] && break
  sleep 0.2
done
[ -n "$nic" ] || fail "no network interface (virtio_net)"
ip addr add "$addr/24" dev "$nic"
ip link set "$nic" up
hostname "$me"
# The guest's root is the host's, read-only: its /etc/hosts is a copy with the nodes added.
cp /etc/hosts "$local_dir/hosts"
printf '10.91.0.1 nodea\n10.91.0.2 nodeb\n' >> "$local_dir/hosts"
mount --bind "$local_dir/hosts" /etc/hosts
# No ping on this machine: a UDP datagram makes the kernel resolve the peer's address (ARP);
# its answer, the peer's MAC in the neighbour table, says the link works.
for i in $(seq 1 120); do
  "$py" -I -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('$peer', 9))" \
    2>/dev/null || true
  sleep 1
  ip neigh show "$peer" | grep -q lladdr && break
  [ "$i" = 120 ] && fail "the other node ($peer) never answered ARP"
done
say "link up: $nic $addr, $peer is $(ip neigh show "$peer" | grep -o 'lladdr [^ ]*')"

# -- the shared store: NFS from node A, mounted by both at /mnt/shared ------------------------
if [ "$role" = a ]; then
  export_dir=$scratch/shared
  mkdir -p "$export_dir"/{store,out,work}
  chmod 755 "$export_dir" "$export_dir/out" "$export_dir/work"
  modprobe nfsd && modprobe nfsv4 || fail "no nfsd in the guest kernel"
  mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd
  # The guest's root is the host's, read-only: the server's state and exports on tmpfs.
  mount -t tmpfs -o mode=755 nfs-state /var/lib/nfs
  : > "$scratch/exports"
  mount --bind "$scratch/exports" /etc/exports
  mkdir -p /var/lib/nfs/rpc_pipefs /var/lib/nfs/v4recovery /run/rpcbind
  mountpoint -q /var/lib/nfs/rpc_pipefs || mount -t rpc_pipefs sunrpc /var/lib/nfs/rpc_pipefs
  : > /var/lib/nfs/etab; : > /var/lib/nfs/rmtab
  rpcbind -w 2>/dev/null || rpcbind
  echo "$export_dir 10.91.0.0/24(rw,sync,no_subtree_check,no_root_squash,fsid=0)" > /etc/exports
  exportfs -ra
  echo 10 > /proc/fs/nfsd/nfsv4gracetime  # a dead node's locks go in seconds (lease: 10 s)
  echo 10 > /proc/fs/nfsd/nfsv4leasetime
  rpc.mountd
  rpc.nfsd 4
  touch "$dir/nfs-ready"
else
  modprobe nfsv4 || fail "no nfsv4 in the guest kernel"
  wait_file "$dir/nfs-ready" 300 || fail "node A never exported the store"
fi
mount -t nfs4 -o vers=4.2,hard,timeo=600 nodea:/ "$shared" || fail "cannot mount nodea:/ at $shared"
say "store: $(findmnt -n -o FSTYPE,SOURCE "$shared")"

# -- munge and Slurm ----------------------------------------------------------------------------
# Everything munged writes in /run (the root is read-only): the key, its seed, its socket.
mkdir -p /run/munge && chmod 700 /run/munge
cp "$dir/munge.key" /run/munge/og.key && chmod 400 /run/munge/og.key
munged --force --key-file=/run/munge/og.key --socket=/run/munge/munge.socket.2 \
  --seed-file=/run/munge/munged.seed --log-file="$dir/log/munged-$me.log" \
  --pid-file=/run/munge/munged.pid --num-threads=2 || fail "munged did not start"
export SLURM_CONF=$dir/slurm.conf
if [ "$role" = a ]; then
  # Node A is too small for the job once it asks for grow x mem: only node B can take it then.
  cat > "$dir/slurm.conf.tmp" <<EOF
ClusterName=oomguard2
SlurmctldHost=nodea(10.91.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$local_dir/state
SlurmdSpoolDir=$local_dir/spool
SlurmctldPidFile=$local_dir/slurmctld.pid
SlurmdPidFile=$local_dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld-nodea.log
SlurmdLogFile=$dir/log/slurmd-%n.log
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
NodeName=nodea NodeAddr=10.91.0.1 CPUs=1 RealMemory=$real_a State=UNKNOWN
NodeName=nodeb NodeAddr=10.91.0.2 CPUs=1 RealMemory=$real_b State=UNKNOWN
PartitionName=lane Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat > "$dir/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v2
IgnoreSystemd=yes
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
AllowedRAMSpace=100
EOF
  mv "$dir/slurm.conf.tmp" "$dir/slurm.conf"
else
  wait_file "$dir/slurm.conf" 300 || fail "node A never wrote slurm.conf"
fi
mkdir -p /sys/fs/cgroup/system.slice
for c in memory pids cpu; do
  echo "+$c" > /sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null || true
done
if [ "$role" = a ]; then slurmctld -i || fail "slurmctld did not start"; fi
slurmd -N "$me" || fail "slurmd did not start"

# -- podman on this node: its own storage in /run, runc, the cgroupfs manager -------------------
pod=(podman --root /run/og-podman/storage --runroot /run/og-podman/run --storage-driver vfs
     --cgroup-manager cgroupfs --runtime runc --events-backend file --tmpdir /run/og-podman/tmp)
mkdir -p /run/og-podman/tmp /sys/fs/cgroup/og-containers
for c in memory pids; do echo "+$c" > /sys/fs/cgroup/og-containers/cgroup.subtree_control; done
pod_toml=$(printf '"%s", ' "${pod[@]}")

# -- oomguard on this node: the store shared, this node's records in /run ----------------------
# Node A also guards the containers podman runs there (checkpointed through podman); node B
# does not: a restored container keeps its limit (podman restores the container's own spec),
# so there it would cross its threshold again at once.
container_guard=""
[ "$role" = a ] && container_guard='
[[guard]]
cgroups = ["/og-containers/libpod-[0-9a-f]*"]
threshold = "75%"'
sock=/run/oomguard-lane.sock
cat > "$local_dir/oomguard.toml" <<EOF
[daemon]
store = "$shared/store"
socket = "$sock"
rescan_interval = "1s"
store_max_size = "50%"
store_keep_free = "5%"

[slurm]
after_checkpoint = "requeue"
grow_memory = $grow

[podman]
engine = "on"
command = [${pod_toml%, }]

[[guard]]
cgroups = ["/system.slice/*slurmstepd.scope/job_*"]
threshold = "80%"
$container_guard
EOF
"$py" -m oomguard --log-format json run --config "$local_dir/oomguard.toml" \
  > "$dir/log/oomguard-$me.log" 2>&1 &
guard=$!
for _ in $(seq 1 120); do grep -q '"guard.started"' "$dir/log/oomguard-$me.log" && break; sleep 1; done
sleep 2
kill -0 "$guard" 2>/dev/null || fail "oomguard exited at start"
grep -o '"node_state": "[^"]*"' "$dir/log/oomguard-$me.log" | head -n1 | sed 's/^/[cluster-lane '"$me"'] /' >&2
touch "$dir/ready.$role"

if [ "$role" = b ]; then
  for _ in $(seq 1 2400); do
    [ -e "$dir/finished.a" ] && break
    if [ -e "$dir/container-archive" ] && [ ! -e "$dir/container-restored" ]; then
      # A's container, checkpointed there by podman into the shared store: the image as A
      # saved it (the same image ID), then a new container from the archive.
      if "${pod[@]}" load -q -i $shared/work/og-hog.oci.tar >&2 &&
          t0=$(date +%s.%N) &&
          "${pod[@]}" container restore --import "$(cat "$dir/container-archive")" \
            --name og2 >&2; then
        t1=$(date +%s.%N)
        say "container restored from $(cat "$dir/container-archive") in $("$py" -c "print(round($t1 - $t0, 1))") s"
        echo ok > "$dir/container-restored"
      else
        echo "podman could not restore it on nodeb" > "$dir/container-restored"
      fi
    fi
    if [ -e "$dir/bench-read" ] && [ ! -e "$dir/bench-read.json" ]; then
      # The store's read rate from this node, cold: a file of the job's size node A wrote.
      sync; echo 3 > /proc/sys/vm/drop_caches
      t0=$(date +%s.%N); cat "$(cat "$dir/bench-read")" > /dev/null; t1=$(date +%s.%N)
      printf '{"bytes": %s, "seconds": %s}\n' "$(stat -c %s "$(cat "$dir/bench-read")")" \
        "$("$py" -c "print(round($t1 - $t0, 3))")" > "$dir/bench-read.json"
    fi
    sleep 1
  done
  [ -e "$dir/finished.a" ] || say "node A never finished"
  kill "$guard" 2>/dev/null || true
  exit 0
fi

# -- node A: the scenario ------------------------------------------------------------------------
wait_file "$dir/ready.b" 600 || fail "node B never came up"
for _ in $(seq 1 180); do
  [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed)$')" = 2 ] && break
  sleep 1
done
sinfo -h -N -o '%N %T %m' | sed 's/^/[cluster-lane nodea] sinfo: /' >&2
[ "$(sinfo -h -N -o '%N %T' | grep -cE ' (idle|mixed)$')" = 2 ] || fail "the two nodes are not both up"
# The first run must land on A: B is drained until it runs there.
scontrol update NodeName=nodeb State=DRAIN Reason=cluster-lane
# A job's PIDs must be free on the node it is restored on: start A's far above B's (a real
# cluster runs jobs with `oomguard exec`, PID 1 of a namespace of their own: docs/cluster.md).
echo 30000 > /proc/sys/kernel/ns_last_pid  # pid_max: 32768 on a 1-CPU guest
target=$((mem * 5 / 4))  # never reached on node A: checkpointed at 80% of --mem
rate=$((mem >= 1024 ? 60 : 20))
cat > $shared/work/job.sh <<EOF
#!/bin/bash
if [ "\${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  date +%s.%N > "$dir/t-batch-start"  # bench/crossnode.py: when the requeued job began
  exec "$py" -m oomguard --store $shared/store --socket "$sock" --log-format json resume-job
fi
sleep 3
exec "$py" "$repo/tests/workloads/hog.py" --log $shared/out/hog.log --target $target --rate $rate \
  --count $((target / 4 + 320)) --tick 0.02
EOF
chmod 755 $shared/work/job.sh
job=$(sbatch --parsable --mem=${mem}M --requeue -D $shared/work -o "$shared/out/job-%j.out" \
  $shared/work/job.sh) || fail "sbatch failed"
say "submitted job $job"
for _ in $(seq 1 300); do
  scontrol show job "$job" | grep -q "JobState=RUNNING" && break
  sleep 1
done
first=$(scontrol show job "$job" | grep -o ' NodeList=[^ ]*' | head -n1)
say "first run:$first"
echo "$first" | grep -q nodea || fail "the first run is not on nodea ($first)"
scontrol update NodeName=nodeb State=RESUME
for _ in $(seq 1 1200); do
  grep -q "^done " $shared/out/hog.log 2>/dev/null && break
  sleep 1
done
info=$(scontrol show job "$job")
second=$(echo "$info" | grep -o ' NodeList=[^ ]*' | head -n1)
restarts=$(echo "$info" | grep -o 'Restarts=[0-9]*' | head -n1)
say "then:$second $restarts"
grep -q '"checkpoint.done"' "$dir/log/oomguard-nodea.log" || fail "no checkpoint on nodea"
grep -q '"slurm.notified"' "$dir/log/oomguard-nodea.log" || fail "Slurm was not told on nodea"
count=$((target / 4 + 320))
grep -q "^done $count ok" $shared/out/hog.log || fail "the job did not finish intact ($second $restarts)"
echo "$second" | grep -q nodeb || fail "the job did not finish on nodeb ($second)"
counts=$(grep -E '^[0-9]+ ' $shared/out/hog.log | cut -d' ' -f1 | tr '\n' ' ')
[ "$counts" = "$(seq -s ' ' 1 $count) " ] || fail "counts out of order or missing"
grep -q '"restore.done"\|"restore.exited"' "$dir/log/oomguard-nodeb.log" ||
  say "note: no restore event in nodeb's daemon log"
cp $shared/out/job-*.out "$dir/log/" 2>/dev/null || true
# Where A's daemon caught the job: at its threshold (memory.high there, set again if
# slurmstepd wrote its own over it) or only at its limit.
"$py" - "$dir/log/oomguard-nodea.log" <<'PY' | sed 's/^/[cluster-lane nodea] /' >&2 || true
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
crossed = next(e for e in events if e.get("event") == "threshold.crossed")
taken = [e for e in events if e.get("event") == "guard.high_taken_back"]
print(f"caught at {crossed['usage'] / 2**20:.0f} of {crossed['limit'] / 2**20:.0f} MiB "
      f"({crossed['source']}); memory.high taken back and set again {len(taken)} time(s)")
PY
say "slurm: job $job checkpointed on nodea, resumed on nodeb"

# -- a container podman runs on A, checkpointed there by podman, restored by podman on B -------
# The image: one static program from a rootfs tarball (no registry), saved for B to load.
mkdir -p "$local_dir/rootfs/out" $shared/out2
gcc -static -O1 -o "$local_dir/rootfs/hog" "$repo/tests/workloads/hog.c" || fail "gcc failed"
tar -C "$local_dir/rootfs" -cf "$local_dir/rootfs.tar" . || fail "tar failed"
"${pod[@]}" import -q "$local_dir/rootfs.tar" og-hog:lane >/dev/null || fail "podman import failed"
"${pod[@]}" save -q --format oci-archive -o $shared/work/og-hog.oci.tar og-hog:lane ||
  fail "podman save failed"
cid=$("${pod[@]}" run --detach --name og1 --network none --memory 160m --memory-swap 160m \
  --cgroup-parent /og-containers --volume $shared/out2:/out og-hog:lane \
  /hog /out/hog.log 150 400) || fail "podman run failed"
say "container ${cid:0:12} runs on nodea: 150 MiB in 160m, guarded at 75%"
for _ in $(seq 1 600); do
  grep -q '"podman.checkpointed"' "$dir/log/oomguard-nodea.log" && break
  sleep 1
done
archive=$(grep '"podman.checkpointed"' "$dir/log/oomguard-nodea.log" | head -n1 |
  "$py" -c 'import json, sys; print(json.loads(sys.stdin.readline())["archive"])') ||
  fail "podman did not checkpoint the container on nodea"
state=$("${pod[@]}" inspect --format '{{.State.Status}}' og1)
[ "$state" = exited ] || fail "the container is $state on nodea after its checkpoint"
grep -q '^done' $shared/out2/hog.log && fail "the container finished before its checkpoint"
echo "$archive" > "$dir/container-archive"
wait_file "$dir/container-restored" 900 || fail "nodeb never restored the container"
[ "$(cat "$dir/container-restored")" = ok ] || fail "$(cat "$dir/container-restored")"
for _ in $(seq 1 600); do grep -q '^done' $shared/out2/hog.log && break; sleep 1; done
grep -q '^done 400 ok' $shared/out2/hog.log || fail "the container did not finish intact on nodeb"
counts=$(grep '^count ' $shared/out2/hog.log | cut -d' ' -f2 | tr '\n' ' ')
[ "$counts" = "$(seq -s ' ' 1 400) " ] || fail "the container's counts are out of order or missing"
say "podman: container ${cid:0:12} checkpointed on nodea ($(basename "$archive")), restored on nodeb, done 400 ok"
if [ "$bench" = 1 ]; then
  # The store's write rate from this node: a file of the job's checkpointed size, fsync'd.
  size=$((mem * 4 / 5))
  t0=$(date +%s.%N)
  dd if=/dev/zero of=$shared/store/.bench-rate bs=1M count=$size conv=fsync status=none
  t1=$(date +%s.%N)
  printf '{"bytes": %s, "seconds": %s}\n' $((size << 20)) "$("$py" -c "print(round($t1 - $t0, 3))")" \
    > "$dir/bench-write.json"
  echo "$shared/store/.bench-rate" > "$dir/bench-read"
  wait_file "$dir/bench-read.json" 600 || say "node B never measured the read rate"
  rm -f $shared/store/.bench-rate
fi
echo "PASS: job $job checkpointed on nodea, resumed on nodeb" > "$dir/result"
say "$(cat "$dir/result")"
touch "$dir/finished.a"
kill "$guard" 2>/dev/null || true
