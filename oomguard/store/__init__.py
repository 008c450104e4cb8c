"""The checkpoint store: its directories and meta.json (checkpoints), the images' checksums
(integrity, digest, commit, verify), CRIU's action script and its gate (criu_hook,
hookgate), and the durable ledgers of what oomguard changed (ledger)."""
