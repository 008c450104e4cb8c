"""The checkpoint store: its directories and meta.json (checkpoints), the images' checksums
(integrity, digest, commit, verify), the durable ledgers of what oomguard changed (ledger),
and meta.json's schema."""
