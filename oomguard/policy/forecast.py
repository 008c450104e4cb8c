"""The dump throughput time-to-limit counts on (oomguard.detect.timetolimit): measured from
this machine's past dumps."""

from __future__ import annotations


def updated_throughput(previous: float, image_bytes: int, dump_seconds: float,
                       weight: float = 0.3) -> float:
    """An exponentially weighted mean of measured dump throughputs (bytes/s)."""
    if dump_seconds <= 0 or image_bytes <= 0:
        return previous
    measured = image_bytes / dump_seconds
    return measured if previous <= 0 else (1 - weight) * previous + weight * measured
