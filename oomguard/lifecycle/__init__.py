"""One checkpoint and one restore from end to end: checkpoint (with precheck, storeroom and
dumproom), restore (eager or lazy, with its keeper), a restored job's exit (exitwatch),
whether a checkpoint fits back (restorefit), the files' identities checked before a restore
(fileids), and the Slurm side of a requeue (jobresume)."""
