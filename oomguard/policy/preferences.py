"""Victim preferences, like earlyoom's --prefer/--avoid/--ignore and nohang's regex badness:
`protect` never chooses a match, `prefer` ranks matches first, `avoid` ranks them last. Regexes
are matched against the process name (comm) and its command line."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from oomguard.policy.victims import ProcessTree, rank_victims, with_vram
from oomguard.sense.procfs import ProcessInfo


@dataclass(frozen=True)
class Preferences:
    prefer: tuple[re.Pattern[str], ...] = ()
    avoid: tuple[re.Pattern[str], ...] = ()
    protect: tuple[re.Pattern[str], ...] = ()
    protect_session_leaders: bool = False  # a login shell or desktop session holds everything
    take_sessions: bool = False  # session processes in victim trees (build_trees takes it)
    gpu: str = "neutral"  # trees holding GPU memory: "prefer" first, "avoid" last in their band


def _matches(patterns: tuple[re.Pattern[str], ...], proc: ProcessInfo) -> bool:
    text = proc.command
    return any(p.search(proc.comm) or p.search(text) for p in patterns)


def is_excluded(proc: ProcessInfo, prefs: Preferences) -> bool:
    """A protected process; also a session leader (login shell, desktop session) when asked,
    except the init of a PID namespace (what `oomguard exec` starts is a session leader too)."""
    if prefs.protect and _matches(prefs.protect, proc):
        return True
    return prefs.protect_session_leaders and proc.session == proc.pid and not proc.is_pidns_init


def apply_preferences(ranked: list[ProcessTree], prefs: Preferences) -> list[ProcessTree]:
    """Drop protected trees (a `protect` match anywhere in a tree protects the tree: dumping the
    tree would stop it; session leaders only at the root), then order: preferred, neutral,
    avoided (by the root), each band in the given order, except that the rule's `gpu`
    preference puts trees holding GPU memory first ("prefer") or last ("avoid") in each band."""
    kept = [t for t in ranked
            if not is_excluded(t.root, prefs)
            and not (prefs.protect and any(_matches(prefs.protect, p) for p in t.members))]

    def band(tree: ProcessTree) -> int:
        if prefs.prefer and _matches(prefs.prefer, tree.root):
            return 0
        if prefs.avoid and _matches(prefs.avoid, tree.root):
            return 2
        return 1

    def gpu_rank(tree: ProcessTree) -> int:
        if prefs.gpu == "prefer":
            return 0 if tree.vram_bytes else 1
        if prefs.gpu == "avoid":
            return 1 if tree.vram_bytes else 0
        return 0

    return sorted(kept, key=lambda t: (band(t), gpu_rank(t)))


def select_victims(trees: Iterable[ProcessTree], vram_by_pid: dict[int, int],
                   prefs: Preferences | None = None) -> list[ProcessTree]:
    """The one victim order, wherever a victim is chosen (a cgroup rule, a system rule,
    systemd-oomd's pre-kill): the trees with their GPU memory, largest footprint first, then
    the rule's preferences (None: the trees' own order; the action worker applies a rule's
    preferences to the candidates it is given)."""
    ranked = rank_victims(with_vram(trees, vram_by_pid))
    return ranked if prefs is None else apply_preferences(ranked, prefs)
