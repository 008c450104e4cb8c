"""A job holding memory of one kind, for the compression benchmark: zeros (written, so the
pages are really there), text (words drawn at random: compresses about as prose does) or
random bytes. Prints "ready" to --log once filled, then every --every seconds rehashes all of
it and appends "pass N ok" (or "CORRUPT"): after a restore, the next pass says whether the
memory came back intact."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time

VOCABULARY = ("memory pressure guard checkpoint restore process page cache disk image kernel "
              "cgroup limit threshold victim freeze dump commit verify lazy fault stream zstd "
              "compress the a of and to in is it that for on with as was at by an be this from "
              "which or have not are but had they you were his her one all there their we can "
              "more when will would been if no so what out up into time only some could them "
              "other than then now its also like over such after most made many before must "
              "through back years where much your way well down should because each just those "
              "people how too little state good very make world still own see men work long get "
              "here between both life being under never day same another know while last might "
              "us great old year off come since against go came right used take three")
WORDS = tuple(VOCABULARY.split())


def fill(kind: str, size: int) -> bytearray:
    if kind == "random":
        return bytearray(os.urandom(size))
    if kind == "zeros":
        buf = bytearray(b"\x01") * size  # every page written...
        buf[:] = bytes(size)  # ...then zeroed: present, not the shared zero page
        return buf
    rng = random.Random(20261201)
    parts, total = [], 0
    while total < size:
        piece = " ".join(rng.choices(WORDS, k=20000)).encode() + b"\n"
        parts.append(piece)
        total += len(piece)
    return bytearray(b"".join(parts)[:size])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("zeros", "text", "random"), required=True)
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--every", type=float, default=0.5)
    args = parser.parse_args()
    memory = fill(args.kind, args.mib << 20)
    digest = hashlib.sha1(memory).digest()
    with open(args.log, "a", buffering=1) as log:
        log.write("ready\n")
        passes = 0
        while True:
            time.sleep(args.every)
            passes += 1
            intact = hashlib.sha1(memory).digest() == digest
            log.write(f"pass {passes} {'ok' if intact else 'CORRUPT'}\n")


if __name__ == "__main__":
    main()
