"""The names of oomguard's own files and directories in the store, declared once.

Each is hidden (a leading dot): the store's listing takes only checkpoint ids, which never
start with one. Everything else in the store is a checkpoint directory, `<id>`.
"""

from __future__ import annotations

# A checkpoint being built: renamed to `<id>` once its images are durable.
PARTIAL_PREFIX = ".partial-"
# Inside a checkpoint directory (partial or whole): the file its dump, its commit and its
# restores flock. A file, not the directory: on NFS an flock on a file is a lock of the server's,
# which every node sees; on a directory it is the client's alone.
CHECKPOINT_LOCK = ".lock"
# CRIU's log of the last failed dump (the event holds only its tail).
LAST_FAILED_LOG = ".last-failed-dump.log"
# The daemon's lock on the store: one daemon per store.
STORE_LOCK = ".daemon.lock"
# The directory of CRIU's action script (oomguard.store.criu_hook).
HOOKS_DIR = ".hooks"
# The archives podman exported for its containers (oomguard.respond.enginestep): not hidden,
# they are the user's to restore (`podman container restore --import`); never a checkpoint id.
CONTAINERS_DIR = "containers"

# The records of what oomguard changed, read back after a crash:
FROZEN_LEDGER = ".frozen.json"  # the trees and cgroups it stopped (oomguard.store.ledger)
OOM_SHIELD = ".oom-shield.json"  # the tasks' oom_score_adj it set to -1000 (act.oomshield)
LIFTS_LEDGER = ".lifted.json"  # the limits lifted for a dump's headroom (act.lifts)
SAVED_HIGH = ".memory-high.json"  # the memory.high values it changed (store.ledger.SavedLimits)
STANDBY_RECORD = ".standby.json"  # the standby of the daemon that runs: pid, start time
# The trees paged out and left stopped until their memory fits (oomguard.store.pagedout),
# and the directory of oomguard's own swap files (oomguard.act.swapfiles).
PAGED_OUT = ".paged-out.json"
SWAP_DIR = ".swap"
# The daemon's recent events of note, for `oomguard status` after a restart (observe.history).
HISTORY = ".history.jsonl"
