"""What one checkpoint is: its meta.json (CheckpointMeta, checked field by field when read),
its id (which names its directory) and its states."""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from oomguard.model.errors import StoreError
from oomguard.model.metaschema import check_value

STATE_DUMPING = "dumping"
STATE_CHECKPOINTED = "checkpointed"
STATE_RESTORED = "restored"
STATE_INCOMPLETE = "incomplete"  # dumped (the process is gone), but the commit did not finish
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


@dataclass
class CheckpointMeta:
    id: str
    pid: int  # root of the dumped tree (host PID)
    pids: list[int]  # every task of the tree: CRIU restores these PIDs
    command: str
    comm: str
    uid: int
    user: str
    cgroup: str  # memory cgroup path inside its hierarchy
    cgroup_version: int
    rss_bytes: int
    reason: str
    criu_version: str
    created: float
    pidns: bool = False  # the tree is the init of its own PID namespace (`oomguard exec`)
    image_bytes: int = 0
    dump_seconds: float = 0.0
    state: str = "checkpointed"  # dumping (provisional) | checkpointed | restored
    restored_at: float | None = None
    restored_pid: int | None = None
    restored_cgroup: str | None = None
    # When the restored tree's root exited (the daemon watches it), and how: exit_status (its
    # exit code) or exit_signal (the signal's name); both None with exited_at set: unknown.
    exited_at: float | None = None
    exit_status: int | None = None
    exit_signal: str | None = None
    gpu_pids: list[int] = field(default_factory=list)  # CUDA processes (pids in the tree's
    # own PID namespace): their state was moved off the GPU with cuda-checkpoint before the dump
    gpu_engine: str = ""  # what checkpointed their CUDA state: cuda-checkpoint | criu-plugin
    vram_bytes: int = 0
    stopped_nspids: list[int] = field(default_factory=list)  # tasks the user had stopped
    # (pids in the tree's own PID namespace): restored stopped, never continued by oomguard
    # The job as a person started it: its command without oomguard exec's init (CMD), and its
    # main process (host PID: the one `ps` showed; the root's first child for an exec job).
    # Older checkpoints lack them: policy/jobs.py job_command derives the command.
    job_command: str = ""
    job_pid: int | None = None
    # Auto-restores that failed, and why it is no longer tried automatically once they
    # reached the rule's restore_attempts ("": not stuck; a person's restore may still try).
    restore_failures: int = 0
    stuck: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        """Raises ValueError saying what is wrong: not JSON, nested too deep, a field missing,
        of the wrong type or out of range. Unknown keys (a newer oomguard's) are ignored."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("meta.json is nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError("meta.json is not a JSON object")
        values = {}
        for spec in fields(cls):
            if spec.name not in data:
                if spec.default is MISSING and spec.default_factory is MISSING:
                    raise ValueError(f"meta.json lacks {spec.name!r}")
                continue
            problem = check_value(spec.name, str(spec.type), data[spec.name])
            if problem is not None:
                raise ValueError(f"meta.json: {problem}")
            values[spec.name] = data[spec.name]
        return cls(**values)


def validate_id(checkpoint_id: str) -> str:
    """Ids name directories: letters, digits, '-' and '_' only (no '/', no '..', no dotfiles)."""
    if not isinstance(checkpoint_id, str) or not ID_RE.fullmatch(checkpoint_id):
        raise StoreError(f"invalid checkpoint id {checkpoint_id!r}")
    return checkpoint_id


def new_id(pid: int, now: float) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"{stamp}-{pid}-{secrets.token_hex(2)}"
