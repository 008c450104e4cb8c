"""One checkpoint and one restore from end to end: checkpoint, restore (eager or lazy, with its
keeper), whether a checkpoint fits back (restorefit, restorewait), the files' identities
checked before a restore (fileids), and the Slurm side of a requeue (jobresume)."""
