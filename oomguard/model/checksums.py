"""The checkpoints' checksum algorithms and their files, named once: the config takes an
algorithm by name (`criu.checksum`), the store (oomguard.store.integrity: the hashing, the
files' format) writes and reads the files. Here, at the bottom of the import graph, both may
import them."""

from __future__ import annotations

XXH3 = "xxh3"  # XXH3-128, the default of new checkpoints
SHA256 = "sha256"  # checkpoints made before, and `checksum = "sha256"`
ALGORITHMS = (XXH3, SHA256)
CHECKSUMS = "SHA256SUMS"  # the older checkpoints' file (and sha256's)
SUMS_FILES = {XXH3: "XXH128SUMS", SHA256: CHECKSUMS}  # verify looks in this order
DIGEST_HEX = {XXH3: 32, SHA256: 64}  # hex digits of a digest
