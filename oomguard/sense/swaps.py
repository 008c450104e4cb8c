"""The machine's swap areas (/proc/swaps) as frozen values: where a page-out can put pages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KiB = 1024


@dataclass(frozen=True)
class SwapArea:
    path: str  # the file or device, as /proc/swaps names it (octal escapes undone)
    kind: str  # file | partition (zram shows as partition)
    size: int  # bytes
    used: int  # bytes
    priority: int

    @property
    def free(self) -> int:
        return max(0, self.size - self.used)


def parse_swaps(text: str) -> list[SwapArea]:
    """/proc/swaps into areas; the header and malformed lines are passed over. The kernel
    escapes a space, tab, newline or backslash in a name as \\040-style octal."""
    areas = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) != 5:
            continue
        name, kind, size, used, priority = fields
        try:
            areas.append(SwapArea(_unescape(name), kind, int(size) * KiB, int(used) * KiB,
                                  int(priority)))
        except ValueError:
            continue
    return areas


def _unescape(name: str) -> str:
    out, index = [], 0
    while index < len(name):
        chunk = name[index:index + 4]
        if chunk[:1] == "\\" and len(chunk) == 4 and all(c in "01234567" for c in chunk[1:]):
            out.append(chr(int(chunk[1:], 8)))
            index += 4
        else:
            out.append(name[index])
            index += 1
    return "".join(out)


class SwapReader:
    def __init__(self, swaps: Path = Path("/proc/swaps")) -> None:
        self.swaps = swaps

    def areas(self) -> list[SwapArea]:
        try:
            return parse_swaps(self.swaps.read_text(errors="replace"))
        except FileNotFoundError:  # a kernel built without swap
            return []

    def free(self) -> int:
        """Room left in every swap area together (zram and zswap's backing areas included)."""
        return sum(area.free for area in self.areas())
