"""Checksums of a checkpoint's image files: written at checkpoint time, verified before restore.

A damaged image restored by CRIU can crash the process or, worse, let it run on with corrupt
memory; so restore refuses a checkpoint whose files do not match.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from oomguard.errors import StoreError

CHECKSUMS = "SHA256SUMS"


def _digest(path: Path) -> str:
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
        # Reading pulled the image into the page cache (charged to us): give it back.
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return digest


def image_files(images: Path) -> list[Path]:
    """The files that make up the images (CRIU's logs are not part of the state)."""
    return sorted(p for p in images.iterdir()
                  if p.is_file() and not p.is_symlink() and not p.name.endswith(".log"))


def compute(images: Path) -> dict[str, str]:
    return {p.name: _digest(p) for p in image_files(images)}


def format_sums(sums: dict[str, str]) -> str:
    """sha256sum(1) format: `sha256sum -c` verifies it from inside images/."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))


def parse_sums(text: str) -> dict[str, str]:
    sums = {}
    for number, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or "/" in name:
            raise StoreError(f"{CHECKSUMS} line {number} is malformed")
        sums[name] = digest
    return sums


def verify(images: Path, sums_file: Path) -> None:
    """Raise StoreError naming every file that is missing, unexpected or altered."""
    try:
        expected = parse_sums(sums_file.read_text())
    except FileNotFoundError:
        raise StoreError(f"checkpoint has no {CHECKSUMS}: cannot verify its images") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"checkpoint's {CHECKSUMS} is unreadable: {exc}") from None
    actual_names = {p.name for p in image_files(images)}
    problems = [f"{name} missing" for name in sorted(set(expected) - actual_names)]
    problems += [f"{name} not in {CHECKSUMS}" for name in sorted(actual_names - set(expected))]
    for name in sorted(set(expected) & actual_names):
        if _digest(images / name) != expected[name]:
            problems.append(f"{name} checksum mismatch")
    if problems:
        raise StoreError("checkpoint is damaged: " + "; ".join(problems))
