"""A job that holds memory and keeps reading all of it: the lazy-restore benchmark's workload.

Fills `--mib` MiB in 1 MiB chunks with a pattern, then passes over every chunk again and again,
checking it, and appends one JSON line per pass to `--log` (start and end wall-clock times, and
whether the memory was intact). A second thread appends the wall-clock time to `--beats` every
`--beat` seconds: after a restore, the first beat says when the job ran again. Both files are
opened for appending, as a restore allows them to have grown.
"""

from __future__ import annotations

import argparse
import threading
import time

CHUNK = 1 << 20  # small: the beating thread gets the GIL between chunks, also while each
# chunk's pages fault in one by one after a lazy restore


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--beats", required=True)
    parser.add_argument("--beat", type=float, default=0.002)
    args = parser.parse_args()
    chunks = [bytes([index % 251]) * CHUNK for index in range(args.mib * (1 << 20) // CHUNK)]
    beats = open(args.beats, "a", buffering=1)  # noqa: SIM115 - held open on purpose
    log = open(args.log, "a", buffering=1)  # noqa: SIM115

    def beat() -> None:
        while True:
            beats.write(f"{time.time():.6f}\n")
            time.sleep(args.beat)
    threading.Thread(target=beat, daemon=True).start()
    passes = 0
    while True:
        passes += 1
        start = time.time()
        intact = all(chunk.count(index % 251) == CHUNK for index, chunk in enumerate(chunks))
        log.write(f'{{"pass": {passes}, "start": {start:.6f}, "end": {time.time():.6f}, '
                  f'"intact": {str(intact).lower()}}}\n')


if __name__ == "__main__":
    main()
