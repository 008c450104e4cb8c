#!/usr/bin/env bash
# Smoke test of the cgroup v2 VM lane. Runs INSIDE the guest, as root:
#     scripts/vm-lane run -- bash tests/vmlane_smoke.sh
# Prints one PASS/FAIL (or SKIP) line per check; exits non-zero if any check failed.
# Not collected by pytest (not a test_*.py file).
set -u

CG=/sys/fs/cgroup
CRIU=${CRIU:-/usr/local/sbin/criu}
SCRATCH=${OOMGUARD_VM_SCRATCH:-$(mktemp -d)}
WORK=$(mktemp -d /tmp/vmlane-smoke.XXXXXX)   # guest-local (tmpfs overlay), for CRIU images
fails=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1${2:+: $2}"; fails=$((fails + 1)); }
skip() { echo "SKIP $1${2:+: $2}"; }

# wait_for SECS CMD...: poll CMD every 0.1 s until it succeeds or SECS pass.
wait_for() {
  local n=$(($1 * 10)); shift
  while [ $n -gt 0 ]; do "$@" && return 0; sleep 0.1; n=$((n - 1)); done
  return 1
}

# start_in CGROUP_DIR CMD...: run CMD in the background as a member of CGROUP_DIR, stdio to
# /dev/null and no other inherited fds (CRIU cannot dump the guest's virtio-serial console fds);
# sets $started_pid.
start_in() {
  local dir=$1; shift
  sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$dir" "$@" \
    </dev/null >/dev/null 2>&1 3>&- 4>&- 5>&- 6>&- 7>&- 8>&- 9>&- &
  started_pid=$!
}

pids=()
cgs=()
cleanup() {
  local p c
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for c in "${cgs[@]}"; do
    [ -d "$c" ] || continue
    echo 0 > "$c/cgroup.freeze" 2>/dev/null
    echo 1 > "$c/cgroup.kill" 2>/dev/null
    wait_for 5 rmdir "$c" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "kernel $(uname -r), $(nproc) CPUs, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MB"

# 1. cgroup2 at /sys/fs/cgroup with the memory controller enabled for children.
fstype=$(stat -f -c %T $CG 2>/dev/null)
if [ "$fstype" = cgroup2fs ] && grep -qw memory $CG/cgroup.subtree_control; then
  pass "cgroup2 mounted at $CG, memory in subtree_control ($(cat $CG/cgroup.subtree_control))"
else
  fail "cgroup2 with memory controller" "fstype=$fstype subtree_control=$(cat $CG/cgroup.subtree_control 2>/dev/null)"
fi

# 2. A child cgroup with memory.max; memory.events exists.
C1=$CG/vmlane-smoke-mem
cgs+=("$C1")
if mkdir "$C1" 2>/dev/null && echo 64M > "$C1/memory.max" &&
   [ "$(cat "$C1/memory.max")" = 67108864 ] && [ -r "$C1/memory.events" ] &&
   grep -q '^oom_kill ' "$C1/memory.events"; then
  pass "child cgroup with memory.max=64M, memory.events present"
else
  fail "child cgroup with memory.max / memory.events" "$(ls "$C1" 2>&1 | tr '\n' ' ')"
fi

# 3. Per-cgroup PSI: memory.pressure exists and a trigger can be registered. The trigger string
#    must end with a NUL byte; without CAP_SYS_RESOURCE the window must be a multiple of 2 s.
if [ -r "$C1/memory.pressure" ]; then
  if { exec 5<>"$C1/memory.pressure"; } 2>/dev/null &&
     err=$(printf 'some 150000 2000000\0' 2>&1 >&5); then
    pass "PSI trigger 'some 150000 2000000' registered on memory.pressure"
  else
    fail "PSI trigger write" "${err:-cannot open}"
  fi
  exec 5>&- 2>/dev/null
else
  fail "memory.pressure exists" "missing in $C1"
fi

# 4. cgroup.freeze: a member task freezes and thaws; cgroup.events reports it.
C2=$CG/vmlane-smoke-freeze
cgs+=("$C2")
frozen() { grep -qx "frozen $2" "$1/cgroup.events"; }
if mkdir "$C2" 2>/dev/null; then
  start_in "$C2" sleep 300; pids+=("$started_pid")
  if wait_for 5 grep -qx "$started_pid" "$C2/cgroup.procs" &&
     echo 1 > "$C2/cgroup.freeze" && wait_for 5 frozen "$C2" 1; then
    if echo 0 > "$C2/cgroup.freeze" && wait_for 5 frozen "$C2" 0; then
      pass "cgroup.freeze: cgroup.events shows frozen 1, then frozen 0 after thaw"
    else
      fail "cgroup.freeze thaw" "$(cat "$C2/cgroup.events")"
    fi
  else
    fail "cgroup.freeze" "$(cat "$C2/cgroup.events" 2>&1 | tr '\n' ' ')"
  fi
  echo 1 > "$C2/cgroup.kill" 2>/dev/null
else
  fail "cgroup.freeze" "cannot create $C2"
fi

# 5. criu check.
if [ ! -x "$CRIU" ]; then
  skip "criu check" "$CRIU not present"
  skip "criu dump/restore in a v2 cgroup" "$CRIU not present"
else
  if out=$("$CRIU" check 2>&1); then
    pass "criu check ($("$CRIU" --version | sed -n "s/^Version: *//p")): $(echo "$out" | tail -n1)"
  else
    fail "criu check" "$(echo "$out" | tail -n3 | tr '\n' ' ')"
  fi

  # 6. Dump and restore a small process in a v2 child cgroup; it must keep running after restore
  #    (a sh loop appending a counter to a file in the scratch dir).
  C3=$CG/vmlane-smoke-criu
  cgs+=("$C3")
  LOG=$SCRATCH/criu-loop.log
  IMG=$WORK/img
  mkdir -p "$IMG"; rm -f "$LOG"
  lines() { wc -l < "$LOG" 2>/dev/null || echo 0; }
  grew() { [ "$(lines)" -gt "$1" ]; }
  criu_fail() {
    fail "criu dump/restore in a v2 cgroup" "$1"
    for f in "$IMG"/dump.log "$IMG"/restore.log; do
      [ -f "$f" ] && { echo "--- errors and tail of $f"; grep -E "Error|Warn" "$f" | head -n 20; tail -n 5 "$f"; }
    done
  }
  if ! mkdir "$C3" 2>/dev/null || ! echo 256M > "$C3/memory.max"; then
    criu_fail "cannot create $C3"
  else
    # setsid: its own session, so the dumped tree does not share our session or process group.
    start_in "$C3" setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i >> "$0"; sleep 0.2; done' "$LOG"
    pid=$started_pid; pids+=("$pid")
    if ! wait_for 10 grew 2; then
      criu_fail "loop did not start"
    elif ! "$CRIU" dump -t "$pid" -D "$IMG" --shell-job -o dump.log -v4 >/dev/null 2>&1; then
      criu_fail "criu dump failed"
    else
      wait "$pid" 2>/dev/null          # reap the dumped task: its PID must be free for restore
      n_dump=$(lines)
      sleep 1
      if [ "$(lines)" != "$n_dump" ]; then
        criu_fail "process still running after dump"
      elif ! "$CRIU" restore -D "$IMG" --shell-job -d -o restore.log -v4 >/dev/null 2>&1; then
        criu_fail "criu restore failed"
      elif ! wait_for 10 grew "$n_dump"; then
        criu_fail "restored process is not appending (log stuck at $n_dump lines)"
      else
        cgline=$(cat /proc/"$pid"/cgroup 2>/dev/null)
        # The counter lives in the restored shell's memory: it must go on from where it was.
        sleep 0.5
        seq_ok=$(awk '$1 != NR {bad=1} END {print bad ? "no" : "yes"}' "$LOG")
        if [ "$seq_ok" != yes ]; then
          criu_fail "counter did not continue after restore: $(tail -n 4 "$LOG" | tr '\n' ' ')"
        elif [ "$cgline" = "0::/vmlane-smoke-criu" ]; then
          pass "criu dump+restore of pid $pid in $C3: counter $n_dump -> $(tail -n1 "$LOG") continued, still in ${cgline#0::}"
        else
          criu_fail "restored process cgroup is '${cgline:-gone}', want 0::/vmlane-smoke-criu"
        fi
      fi
    fi
  fi
fi

if [ $fails -eq 0 ]; then
  echo "vmlane smoke: all checks passed"
else
  echo "vmlane smoke: $fails check(s) FAILED"
fi
[ $fails -eq 0 ]
