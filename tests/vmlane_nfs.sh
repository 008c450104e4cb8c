#!/bin/bash
# A store on NFS, inside the cgroup v2 VM lane (run by tests/integration/test_nfs_lane.py):
#   scripts/vm-lane run --timeout 1500 -- bash tests/vmlane_nfs.sh
# The guest's kernel serves NFS (nfsd; this machine's nfs-kernel-server programs, which the
# guest sees through its read-only root) from a directory of the lane's scratch disk (ext4)
# and mounts it over 127.0.0.1 as NFSv4.2 with the options a cluster node would use (hard,
# the server's locks); "another node" mounts it again in a mount namespace with nosharecache.
# Then tests/integration/test_nfs_store.py runs against that mount ($OOMGUARD_NFS_STORE): real
# daemons, CRIU writing its images over NFS, restores from it. A test gets 900 s at most (its waits are stretched 3x under emulation): one
# that hangs is ended with every thread's stack on stderr.
# Exit 3: no NFS programs on this machine (scripts/setup installs them): a skip.
set -euo pipefail
scratch=${OOMGUARD_VM_SCRATCH:?run inside scripts/vm-lane}
export_dir=$scratch/nfs-export
mnt=/mnt/og-nfs  # a tmpfs on /mnt first: the guest's root is the host's, read-only
say() { printf '[nfs-lane] %s\n' "$*" >&2; }

for p in rpc.nfsd exportfs rpc.mountd mount.nfs rpcbind; do
  command -v "$p" >/dev/null || { say "SKIP: $p not installed (scripts/setup installs it)"; exit 3; }
done
modprobe nfsd && modprobe nfsv4 || { say "FAIL: the guest kernel has no nfsd/nfsv4"; exit 1; }
mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd
# The guest's root is the host's, read-only: the server's state, its exports file and the
# mount point go on tmpfs (nothing of the host's NFS set-up is read or changed).
mount -t tmpfs -o mode=755 nfs-state /var/lib/nfs
mountpoint -q /mnt || mount -t tmpfs -o mode=755 mnt /mnt
: > "$scratch/exports"
mount --bind "$scratch/exports" /etc/exports
mkdir -p /var/lib/nfs/rpc_pipefs /var/lib/nfs/v4recovery /run/rpcbind "$export_dir" "$mnt"
mountpoint -q /var/lib/nfs/rpc_pipefs || mount -t rpc_pipefs sunrpc /var/lib/nfs/rpc_pipefs
: > /var/lib/nfs/etab; : > /var/lib/nfs/rmtab
ip link set lo up
rpcbind -w 2>/dev/null || rpcbind
# no_root_squash: the daemon and CRIU write the store as root, as on a cluster's store export.
echo "$export_dir 127.0.0.1(rw,sync,no_subtree_check,no_root_squash,fsid=0)" > /etc/exports
exportfs -ra
# A short grace period and lease (the minimum, 10 s): a lock of a node that died (its lease not
# renewed) is let go in seconds, and the server accepts new opens and locks soon after it starts.
echo 10 > /proc/fs/nfsd/nfsv4gracetime
echo 10 > /proc/fs/nfsd/nfsv4leasetime
rpc.mountd
rpc.nfsd 2
mount -t nfs4 -o vers=4.2,hard,timeo=600 127.0.0.1:/ "$mnt" || { say "FAIL: cannot mount the export"; exit 1; }
say "store file system: $(findmnt -n -o FSTYPE,SOURCE,OPTIONS "$mnt" | cut -c1-120)"
export OOMGUARD_NFS_STORE=$mnt
# A watchdog: every 60 s, where each oomguard process and each process in uninterruptible
# sleep waits in the kernel (a hang on the NFS mount shows there), and the daemons' last words.
watchdog() {
  while sleep 60; do
    for d in /proc/[0-9]*; do
      cmd=$(tr '\0' ' ' 2>/dev/null < "$d/cmdline") || continue
      state=$(awk '/^State:/ {print $2}' "$d/status" 2>/dev/null)
      case "$cmd" in *" -m oomguard "*|*criu*) ;; *) [ "$state" = D ] || continue ;; esac
      say "watchdog: pid ${d#/proc/} state $state: ${cmd:0:120}"
      for t in "$d"/task/*; do
        printf '[nfs-lane]   task %s wchan %s: %s\n' "${t##*/}" "$(cat "$t/wchan" 2>/dev/null)" \
          "$(head -n 6 "$t/stack" 2>/dev/null | awk '{print $2}' | tr '\n' ' ')" >&2
      done
    done
    for c in /sys/fs/cgroup/oomguard-test-*/; do
      [ -d "$c" ] || continue
      say "watchdog: $c current $(cat "$c/memory.current") high $(cat "$c/memory.high") max $(cat "$c/memory.max") events $(tr '\n' ' ' < "$c/memory.events") procs $(tr '\n' ' ' < "$c/cgroup.procs")"
      for p in $(cat "$c/cgroup.procs"); do
        say "watchdog:   pid $p $(awk '/^State:/ {print $2}' /proc/$p/status) wchan $(cat /proc/$p/wchan): $(head -n 4 /proc/$p/stack | awk '{print $2}' | tr '\n' ' ')"
      done
    done
    for f in "$scratch"/pytest/*/daemon.log; do
      [ -f "$f" ] && say "watchdog: $f: $(tail -n 1 "$f" | cut -c1-300)"
    done
  done
}
watchdog &
watch_pid=$!
set +e
.venv/bin/python -m pytest -p no:cacheprovider -q -rfEs -o timeout=900 -o timeout_method=thread \
  --basetemp "$scratch/pytest" ${OOMGUARD_NFS_TESTS:-tests/integration/test_nfs_store.py}
rc=$?
kill "$watch_pid" 2>/dev/null
umount "$mnt" 2>/dev/null
rpc.nfsd 0 2>/dev/null
exit $rc
