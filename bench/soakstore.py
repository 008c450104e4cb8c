"""The soak drill's small store: a real ext4 file system on a loop device, mounted where the
daemon keeps its checkpoints, with a budget; and the watch that proves the budget held (the
file system never below store_keep_free, sampled every few milliseconds; the store never over
store_max_size, read every turn of the drill)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from oomguard.policy.budget import resolve
from oomguard.store.budget import disk_used

CAP = 0.75  # store_max_size: a share of the small file system
KEEP_FREE = 0.10  # store_keep_free


@contextlib.contextmanager
def loop_store(workdir: Path, size_mib: int) -> Iterator[Path]:
    """An ext4 file system of `size_mib` MiB (no blocks reserved for root) on a loop device,
    mounted at workdir/small; its image file lives in workdir and goes with the mount."""
    image, mount_point = workdir / "small.img", workdir / "small"
    mount_point.mkdir(parents=True)
    with open(image, "wb") as handle:
        handle.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-d", str(mount_point)], check=False)
        image.unlink(missing_ok=True)


def budget_config() -> str:
    """The [daemon] keys of the small store's budget."""
    return f'store_max_size = "{CAP:.0%}"\nstore_keep_free = "{KEEP_FREE:.0%}"\n'


@dataclass
class BudgetFigures:
    total: int
    cap: int
    keep_free: int
    lowest_free: int
    highest_used: int = 0

    def problems(self) -> list[str]:
        found = []
        if self.lowest_free < self.keep_free:
            found.append(f"the store's file system fell to {self.lowest_free >> 20} MiB free, "
                         f"below store_keep_free ({self.keep_free >> 20} MiB)")
        if self.highest_used > self.cap:
            found.append(f"the store reached {self.highest_used >> 20} MiB, over "
                         f"store_max_size ({self.cap >> 20} MiB)")
        return found


class BudgetWatch:
    """Samples the small store's file system in a thread; `turn()` reads the store's size."""

    def __init__(self, mount_point: Path, store: Path) -> None:
        self.mount_point = mount_point
        self.store = store
        fs = os.statvfs(mount_point)
        total = fs.f_blocks * fs.f_frsize
        self.figures = BudgetFigures(total=total, cap=resolve(CAP, total) or 0,
                                     keep_free=resolve(KEEP_FREE, total) or 0,
                                     lowest_free=self._free())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-budget", daemon=True)
        self._thread.start()

    def _free(self) -> int:
        fs = os.statvfs(self.mount_point)
        return fs.f_bavail * fs.f_frsize

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.figures.lowest_free = min(self.figures.lowest_free, self._free())

    def turn(self) -> None:
        self.figures.highest_used = max(self.figures.highest_used, disk_used(self.store))

    def stop(self) -> BudgetFigures:
        self.turn()
        self._stop.set()
        self._thread.join()
        return self.figures
