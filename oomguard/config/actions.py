"""Action chains: what a rule does to its victim, in order, until one step settles it.

    actions = ["checkpoint", "pageout"]           # the default (on_failure = "thaw")
    actions = ["checkpoint", "pageout", "kill"]   # ... else kill (on_failure = "kill")
    actions = ["checkpoint"]                      # checkpoint, else leave it running
    actions = ["freeze", "checkpoint", "kill"]    # stop growth at once, then decide
    actions = ["signal:SIGUSR1:30s", "checkpoint"] # cooperative: let the trainer save itself
    actions = ["vram", "checkpoint"]              # GPU pressure: free the GPU, keep it running

Parsing is pure; the executor lives in oomguard/respond/chain.py.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from oomguard.model.units import MAX_WAIT, parse_duration

FREEZE, CHECKPOINT, SIGNAL, KILL = "freeze", "checkpoint", "signal", "kill"
VRAM = "vram"  # cuda-checkpoint alone: CUDA state into host memory, the process stays alive
PAGEOUT = "pageout"  # the tree's memory into swap, the tree kept stopped until it fits again
DEFAULT_CHAIN = (CHECKPOINT, PAGEOUT)  # what CRIU cannot dump goes to swap, held


@dataclass(frozen=True)
class Step:
    kind: str  # freeze | checkpoint | signal | vram | pageout | kill
    signal: int = 0  # for signal steps
    grace: float = 0.0  # for signal steps: how long to wait for the process to exit or shrink

    def __str__(self) -> str:
        if self.kind == SIGNAL:
            return f"signal:{signal.Signals(self.signal).name}:{self.grace:.15g}s"
        return self.kind


def parse_step(text: str) -> Step:
    if not isinstance(text, str):
        raise ValueError(f"expected an action such as 'checkpoint', got {text!r}")
    parts = text.strip().split(":")
    kind = parts[0].lower()
    if kind in (FREEZE, CHECKPOINT, KILL, VRAM, PAGEOUT):
        if len(parts) != 1:
            raise ValueError(f"{kind!r} takes no arguments, got {text!r}")
        return Step(kind)
    if kind == SIGNAL:
        if len(parts) != 3:
            raise ValueError(f"expected 'signal:SIGNAME:GRACE' such as 'signal:SIGUSR1:30s', "
                             f"got {text!r}")
        name = parts[1].upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        try:
            number = signal.Signals[name].value
        except KeyError:
            raise ValueError(f"unknown signal {parts[1]!r} in {text!r}") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name} cannot be a cooperative signal: use 'kill' or 'freeze'")
        grace = parse_duration(parts[2])
        if grace <= 0:
            raise ValueError(f"the grace period must be above 0, got {parts[2]!r}")
        if grace > MAX_WAIT:
            raise ValueError(f"the grace period must be at most 1d, got {parts[2]!r}")
        return Step(SIGNAL, number, grace)
    raise ValueError(f"unknown action {parts[0]!r}: expected freeze, checkpoint, "
                     "signal:SIG:GRACE, vram, pageout or kill")


def parse_chain(value: object) -> tuple[Step, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of actions, got {value!r}")
    steps = tuple(parse_step(item) for item in value)
    kinds = [s.kind for s in steps]
    if FREEZE in kinds and kinds.index(FREEZE) != 0:
        raise ValueError("'freeze' can only be the first action")
    if KILL in kinds and kinds.index(KILL) != len(kinds) - 1:
        raise ValueError("'kill' can only be the last action: nothing runs after it")
    if len(set(kinds) - {SIGNAL}) != len([k for k in kinds if k != SIGNAL]):
        raise ValueError("an action other than 'signal' appears twice")
    return steps
