"""Output for people: sizes in KiB/MiB/GiB, times in local time, one checkpoint as an aligned
summary, the line a successful restore prints. Machines get the raw numbers (JSON output and
JSON log lines are never passed through here)."""

from __future__ import annotations

import shlex
import shutil
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from oomguard.model.jobcommand import job_command
from oomguard.model.units import format_size

# Log and event fields that hold bytes (besides any field named *_bytes).
BYTE_FIELDS = frozenset({"usage", "limit", "anon", "resident", "vram", "rss", "available",
                         "total", "bytes", "min_available", "usage_after", "headroom",
                         "freed", "used", "cap", "free", "keep_free", "need", "pending"})
LOCAL_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STATES_TO_RESTORE = ("checkpointed", "incomplete")
ELLIPSIS = "\u2026"
DEFAULT_WIDTH = 120  # the width of output that goes to no terminal (unless $COLUMNS says)
LOG_COMMAND_WIDTH = 60  # a command in a console log line, among the event's other fields
MIN_COMMAND_WIDTH = 20
STR_SHOWN = 4096  # a field's text (a CRIU error) escaped onto one line before the line is cut
VISIBLE_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def output_width() -> int:
    """The terminal's width when stdout is one (else $COLUMNS, else DEFAULT_WIDTH)."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def _visible(ch: str) -> str:
    if ch.isprintable():
        return ch
    escape = VISIBLE_ESCAPES.get(ch)
    if escape is not None:
        return escape
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def one_line(text: str, width: int, *, escape: bool = True) -> str:
    """`text` on one line of at most `width` characters: newlines and tabs shown as \\n and
    \\t, any other control character escaped (a command line cannot move the cursor or
    recolour the terminal), cut with an ellipsis (never inside an escape). `escape=False`:
    only cut (for a renderer that escapes on its own: the console log's)."""
    width = max(width, 1)
    pieces: list[str] = []
    length = 0
    for ch in text:
        piece = _visible(ch) if escape else ch
        if length + len(piece) > width:
            while pieces and (length + len(ELLIPSIS) > width or pieces[-1] in (" ", ELLIPSIS)):
                length -= len(pieces.pop())
            return "".join(pieces) + ELLIPSIS
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)


def meta_command(meta: Mapping[str, Any]) -> str:
    """The command a person gave for a checkpoint's job (not oomguard exec's init), whole."""
    return job_command(meta.get("job_command"), str(meta.get("command") or ""))


def meta_pid(meta: Mapping[str, Any]) -> int:
    """The PID a person saw for the job: its main process (the tree's root when unknown)."""
    job_pid = meta.get("job_pid")
    return job_pid if isinstance(job_pid, int) and job_pid > 0 else int(meta["pid"])


def is_byte_field(key: str) -> bool:
    return key in BYTE_FIELDS or key.endswith("_bytes")


def human_value(key: str, value: Any) -> Any:
    """A byte-valued field's integer as a size ('340.4MiB'), a Unix time (`*_at`) in local
    time; anything else unchanged."""
    if isinstance(value, bool):
        return value
    if is_byte_field(key) and isinstance(value, int):
        return format_size(value)
    if key.endswith("_at") and isinstance(value, (int, float)) and value > 0:
        return local_time(value, zone=False)
    return value


def local_time(epoch: float, zone: bool = True) -> str:
    """'2025-03-01 14:02:07 CET': a Unix time in this machine's local time."""
    moment = time.localtime(epoch)
    text = time.strftime(LOCAL_TIME_FORMAT, moment)
    return f"{text} {time.strftime('%Z', moment)}" if zone else text


def humanize_event(_logger: Any, _method: str,
                   event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor for the console (TTY) renderer: byte fields as sizes, the job's
    own command (not oomguard exec's init) on one line, cut."""
    _job_command_only(event_dict, LOG_COMMAND_WIDTH, escape=False)  # the renderer escapes
    for key, value in list(event_dict.items()):
        event_dict[key] = human_value(key, value)
    return event_dict


def _job_command_only(fields: MutableMapping[str, Any], width: int, *,
                      escape: bool = True) -> None:
    """An event's `command` as people read it: the job's command (`job_command`, which then
    goes: JSON lines keep both, whole), on one line of at most `width` characters."""
    recorded = fields.pop("job_command", None)
    command = fields.get("command")
    if isinstance(command, str) or isinstance(recorded, str):
        whole = job_command(recorded if isinstance(recorded, str) else None,
                            command if isinstance(command, str) else "")
        fields["command"] = one_line(whole, width, escape=escape)


STATUS_LEAD = ("cgroup", "id", "pid", "job_pid")  # what an event is about, before the rest


def event_fields(event: Mapping[str, Any], skip: tuple[str, ...] = ("event", "time", "level"),
                 width: int = DEFAULT_WIDTH) -> str:
    """'cgroup=/jobs/a id=... command=python3 train.py usage=380.0MiB ...': an event's fields
    for a line of `status`, on one line of at most `width` characters: what it is about first,
    then the job's command (at most half the line), then the rest, cut with an ellipsis."""
    fields = {k: v for k, v in event.items() if k not in skip}
    raw_command: dict[str, Any] = {k: fields.pop(k) for k in ("command", "job_command")
                                   if k in fields}

    def shown(key: str) -> str:
        value = human_value(key, fields[key])
        return f"{key}={one_line(value, STR_SHOWN) if isinstance(value, str) else value}"

    parts = [shown(k) for k in STATUS_LEAD if k in fields]
    if raw_command:
        used = len(" ".join(parts)) + len(" command=")
        _job_command_only(raw_command, max(min(width - used, width // 2), MIN_COMMAND_WIDTH))
        parts.append(f"command={raw_command['command']}")
    parts += [shown(k) for k in fields if k not in STATUS_LEAD]
    return one_line(" ".join(parts), width, escape=False)


def restore_command(checkpoint_id: str) -> str:
    """The command that brings `checkpoint_id` back."""
    return f"oomguard restore {shlex.quote(checkpoint_id)}"


def restored_line(result: Mapping[str, Any]) -> str:
    """'restored ID as PID N (was M) into CGROUP' from a Restore reply."""
    was = f" (was {result['was_pid']})" if result.get("was_pid") is not None else ""
    cgroup = result.get("cgroup")
    into = f" into {cgroup}" if cgroup else " (no cgroup)"
    return f"restored {result['id']} as PID {result['pid']}{was}{into}"


def taken_line(meta: Mapping[str, Any], asked: int, width: int = DEFAULT_WIDTH) -> str:
    """Which tree `oomguard checkpoint PID` took, for people (its id goes to stdout): the
    whole `oomguard exec` job when the PID asked for was inside one."""
    root, count = meta["pid"], len(meta.get("pids") or []) or 1
    tasks = f"{count} process{'es' if count > 1 else ''}"
    if asked != root:
        head = (f"oomguard: process {asked} is in the job of {root} (its PID namespace's "
                f"init): checkpointed the whole job, {tasks}: ")
    else:
        head = f"oomguard: checkpointed the tree of {root}, {tasks}: "
    return head + one_line(meta_command(meta), max(width - len(head), MIN_COMMAND_WIDTH))


def _exit_text(meta: Mapping[str, Any]) -> str | None:
    if meta.get("exited_at") is None:
        return None
    how = f"with status {meta['exit_status']}" if meta.get("exit_status") is not None else \
        f"by {meta['exit_signal']}" if meta.get("exit_signal") else "(how unknown)"
    return f"{local_time(meta['exited_at'])} {how}"


def _how_to_restore(meta: Mapping[str, Any]) -> str:
    if meta.get("state") in STATES_TO_RESTORE:
        return restore_command(str(meta["id"]))
    if meta.get("state") == "restored":
        return "already restored"
    return f"not while {meta.get('state')}"


def shown_state(meta: Mapping[str, Any]) -> str:
    """The state as people read it: `stuck` for a checkpoint auto-restore gave up on."""
    if meta.get("stuck") and meta.get("state") in STATES_TO_RESTORE:
        return "stuck"
    return str(meta.get("state"))


def _pid_text(meta: Mapping[str, Any]) -> str:
    """'4243 (the job's main process; its tree: 4242, its PID namespace's init, 3 tasks)'."""
    pids = list(meta.get("pids") or [])
    tasks = f"{len(pids)} tasks" if len(pids) > 1 else ""
    root, shown = meta.get("pid"), meta_pid(meta)
    if shown == root:
        init = "PID namespace init" if meta.get("pidns") else ""
        about = ", ".join(x for x in (tasks, init) if x)
        return f"{root} ({about})" if about else str(root)
    tree = f"its tree: {root}, its PID namespace's init" if meta.get("pidns") else \
        f"its tree: {root}"
    return f"{shown} (the job's main process; {tree}" + (f", {tasks})" if tasks else ")")


def show_rows(meta: Mapping[str, Any], width: int = DEFAULT_WIDTH) -> list[tuple[str, str]]:
    """A checkpoint's meta.json as (label, value) rows for people (the command cut to fit
    `width` with its label)."""
    cgroup = meta.get("cgroup") or "(none)"
    rows = [
        ("id", str(meta["id"])),
        ("state", shown_state(meta)),
        ("command", one_line(meta_command(meta), width - len("resident  "))),  # the longest
        ("pid", _pid_text(meta)),
        ("user", f"{meta.get('user')} (uid {meta.get('uid')})"),
        ("cgroup", f"{cgroup} (cgroup v{meta.get('cgroup_version')})"),
        ("resident", format_size(meta.get("rss_bytes") or 0)),
        ("image", format_size(meta.get("image_bytes") or 0)),
    ]
    if meta.get("vram_bytes"):
        rows.append(("vram", format_size(meta["vram_bytes"])))
    rows.append(("created", local_time(meta["created"])))
    if meta.get("dump_seconds"):
        rows.append(("dump", f"{meta['dump_seconds']:.2f}s"))
    rows.append(("reason", str(meta.get("reason"))))
    if meta.get("restored_at") is not None:
        into = meta.get("restored_cgroup") or "(no cgroup)"
        rows.append(("restored", f"{local_time(meta['restored_at'])} as PID "
                                 f"{meta.get('restored_pid')} into {into}"))
    exited = _exit_text(meta)
    if exited:
        rows.append(("exited", exited))
    if shown_state(meta) == "stuck":
        rows.append(("stuck", one_line(f"no longer tried automatically after "
                                       f"{meta.get('restore_failures')} failed auto-restores: "
                                       f"{meta['stuck']}", width - len("resident  "))))
    rows.append(("restore", _how_to_restore(meta)))
    return rows


def show_text(meta: Mapping[str, Any], width: int = DEFAULT_WIDTH) -> str:
    """`oomguard show ID` for people: one aligned 'label  value' line per row."""
    rows = show_rows(meta, width)
    labels = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(labels)}  {value}" for label, value in rows)


LIST_HEADING = ("ID", "PID", "ROOT", "USER", "RSS", "IMAGE", "STATE", "CREATED", "COMMAND")


def list_text(metas: Sequence[Mapping[str, Any]], width: int = DEFAULT_WIDTH) -> str:
    """`oomguard list` for people: one line per checkpoint, the job's main process (PID) and
    its tree's root (ROOT), its own command last, cut to what is left of `width`."""
    rows = [LIST_HEADING[:-1]]
    for m in metas:
        created = time.strftime(LOCAL_TIME_FORMAT, time.localtime(m["created"]))
        rows.append((str(m["id"]), str(meta_pid(m)), str(m["pid"]), str(m["user"]),
                     format_size(m["rss_bytes"]), format_size(m["image_bytes"]), shown_state(m),
                     created))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    left = max(width - sum(widths) - 2 * len(widths), MIN_COMMAND_WIDTH)
    commands = [LIST_HEADING[-1], *(one_line(meta_command(m), left) for m in metas)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     + "  " + command for row, command in zip(rows, commands, strict=True))


def paged_out_text(trees: Sequence[Mapping[str, Any]]) -> str:
    """`oomguard list`'s second part: the trees paged out and kept stopped until their memory
    fits (or `oomguard resume ID`)."""
    rows = [("PAGED OUT", "PID", "UID", "PAGED", "SINCE", "COMMAND")]
    for t in trees:
        since = time.strftime(LOCAL_TIME_FORMAT, time.localtime(t["since"]))
        rows.append((str(t["id"]), str(t["root_pid"]), str(t["uid"]),
                     format_size(t["paged_bytes"]), since, one_line(str(t["command"]), 40)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def paged_out_detail(tree: Mapping[str, Any], width: int = DEFAULT_WIDTH) -> str:
    """`oomguard show ID|PID` of a paged-out tree: one aligned 'label  value' line per row."""
    since = time.strftime(LOCAL_TIME_FORMAT, time.localtime(tree["since"]))
    rows = [("id", str(tree["id"])), ("state", "paged out: stopped until its memory fits, or "
                                       f"`oomguard resume {tree['id']}`"),
            ("pid", str(tree["root_pid"])), ("uid", str(tree["uid"])),
            ("cgroup", str(tree["cgroup"]) or "-"),
            ("tasks", " ".join(str(task[0]) for task in tree["tasks"])),
            ("paged out", format_size(tree["paged_bytes"])),
            ("resident before", format_size(tree["resident_bytes"])),
            ("since", since), ("command", one_line(str(tree["command"]), max(width - 18, 20))),
            ("swap files", ", ".join(tree["swap_files"]) or "the machine's own swap"),
            ("held by", f"a frozen cgroup of its own ({tree['hold']})" if tree.get("hold")
             else "SIGSTOP (stopped again should anything continue it)")]
    labels = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(labels)}  {value}" for label, value in rows)


def budget_text(store: Mapping[str, Any]) -> str:
    """The store's use against its budget, from `status`'s figures (bytes)."""
    if "error" in store:
        return str(store["error"])
    cap = store.get("cap")
    used = format_size(store.get("used") or 0)
    head = f"{used} used of {format_size(cap)} (store_max_size)" if cap is not None \
        else f"{used} used, no cap"
    keep = store.get("keep_free") or 0
    tail = f", keep {format_size(keep)} free (store_keep_free)" if keep else ""
    over = "; OVER BUDGET: new checkpoints are refused" if store.get("over") else ""
    return f"{head}; {format_size(store.get('free') or 0)} free on its file system{tail}{over}"
