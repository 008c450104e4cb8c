"""The kill drill (`scripts/killdrill --points N`): the daemon SIGKILLed at deterministic-random
moments of a checkpoint (freeze, limit lift, dump, commit) and of a restore, then restarted;
after each restart every freeze must have ended, every lifted limit be back, and nothing be lost.

Each point: a fresh store and a guarded cgroup (LIMIT, the default 85% threshold, parked at its
limit), a hog that counts and grows past the threshold, the real daemon and the real CRIU. The
daemon is killed OFFSET ms after an event it logs: `threshold.crossed` for the checkpoint's
phases, the Restore call on its control socket for a restore. Offsets are drawn (from --seed)
across each phase's window, measured first on --calibrate runs that are not killed. Then a
second daemon starts on the same store, and the point checks:

- nothing is left stopped: no task of the hog's cgroups in state T or t, no cgroup.freeze set;
- no limit is left lifted: the cgroup's limit is LIMIT again (and oom_kill_disable is put back
  once the second daemon stops);
- nothing is lost: the job runs on, or a whole checkpoint restores it, and it counts on to its
  end from where it was, its memory verified (`done COUNT ok`, every count once, in order).

Exit status 0 when every point holds, 1 (each failure with its point, phase, offset and the
seed to run it again) otherwise. --out writes the markdown table."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import cgroup_factory, machine
from oomguard.cgroup.base import MemoryCgroup
from oomguard.control.client import ControlClient
from oomguard.model.errors import OomguardError
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from oomguard.store.ledger import FrozenLedger
from oomguard.store.names import FROZEN_LEDGER, PARTIAL_PREFIX
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    hog_argv,
    kill_pid,
    last_count,
    read_counts,
    start_in_cgroup,
    wait_until,
)

PHASES = ("freeze", "lift", "dump", "commit", "restore")
LIMIT = 128 * MiB  # the guarded cgroup's limit (the threshold is the default 85%)
BIG = 512 * MiB  # where a checkpoint is restored (unguarded: the job runs to its end there)
TARGET_MIB = 160  # the hog grows past the threshold (and the limit: it is parked there)
COUNT = 150  # steps: 40 to grow, then one per TICK
TICK = 0.02
SETTLE_S = 60.0  # the restarted daemon has this long to settle what the killed one left
STOPPED = ("T", "t")


@dataclass
class Phases:
    """Seconds from the anchor (the hog's start; a restore's: its call), as the calibration
    runs measured them (their medians)."""

    crossed: float  # -> threshold.crossed seen
    frozen: float  # -> victim.frozen seen
    dump_end: float  # -> CRIU done, the tree gone (checkpoint.done less its commit)
    done: float  # -> checkpoint.done seen
    restore: float  # Restore called -> answered

    def windows(self, phase: str) -> list[tuple[float, float]]:
        """Where a kill in `phase` is drawn from (one of these, then a point in it)."""
        if phase == "freeze":  # from just before the crossing to the tree stopped
            return [(max(self.crossed - 0.03, 0.0), self.frozen + 0.005)]
        if phase == "lift":  # the lift (between the SIGSTOPs and victim.frozen), its undoing
            return [(max(self.crossed - 0.005, 0.0), self.frozen + 0.05),
                    (self.dump_end - 0.05, self.dump_end + 0.03)]
        if phase == "dump":
            return [(self.frozen, self.dump_end)]
        if phase == "commit":
            return [(self.dump_end - 0.01, self.done + 0.01)]
        return [(0.0, self.restore)]


@dataclass
class Point:
    index: int
    phase: str
    offset_ms: float
    seen: str = ""  # the last event the daemon had logged when it was killed
    outcome: str = ""  # how the job went on: ran on / restored / restored again...
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


class LogTail:
    """A daemon's JSON log, read as it grows: (event, when it was first seen)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.seen: list[tuple[str, float, dict[str, Any]]] = []

    def poll(self) -> None:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        self.offset += len(data)
        now = time.monotonic()
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and "event" in event:
                    self.seen.append((str(event["event"]), now, event))

    def first(self, name: str) -> tuple[float, dict[str, Any]] | None:
        for event, when, fields in self.seen:
            if event == name:
                return when, fields
        return None

    def wait(self, name: str, timeout: float) -> tuple[float, dict[str, Any]] | None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            found = self.first(name)
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.0005)

    def last(self, names: tuple[str, ...]) -> str:
        self.poll()
        hits = [event for event, _, _ in self.seen if event in names]
        return hits[-1] if hits else "none"


MILESTONES = ("threshold.crossed", "victim.chosen", "victim.frozen", "checkpoint.done",
              "checkpoint.failed", "restore.done", "restore.failed")


class Drill:
    def __init__(self, factory: CgroupFactory, workdir: Path, seed: int) -> None:
        self.factory = factory
        self.workdir = workdir
        self.seed = seed
        self.proc = ProcReader()
        self.dumping: list[str] = []  # partials a CRIU was writing when the daemon was killed

    # -- one point -------------------------------------------------------------------------

    def point(self, index: int, phase: str | None, offset: float | None) -> tuple[Point, dict[str, float]]:
        """One run: killed at `offset` s into `phase` (None: a calibration run, not killed).
        Returns the point and the times measured (for calibration)."""
        began = time.monotonic()
        result = Point(index, phase or "calibration", round((offset or 0.0) * 1000, 1))
        self.dumping = []
        here = self.workdir / f"p{index:03d}"
        here.mkdir(parents=True)
        store = here / "store"
        cg = self.factory.make(f"k{index}", LIMIT)
        big = self.factory.make(f"k{index}big", BIG)
        log = here / "hog.log"
        times: dict[str, float] = {}
        daemons: list[DaemonProcess] = []
        hog: subprocess.Popen[bytes] | None = None
        try:
            first = DaemonProcess(store, here / "daemon1.log", "--cgroup", str(cg.path))
            daemons.append(first)
            tail = LogTail(first.log)
            if tail.wait("guard.armed", 60) is None:
                result.failures.append("the first daemon never armed")
                return result, times
            hog = start_in_cgroup(cg, hog_argv(log, target=TARGET_MIB, rate=400, count=COUNT,
                                               tick=TICK))
            anchor = time.monotonic()
            if phase is not None and phase != "restore":
                assert offset is not None
                self._sleep_until(anchor + offset)
                result.seen = self._kill(first, tail, store)
            else:
                done = tail.wait("checkpoint.done", 60)
                frozen = tail.first("victim.frozen")
                crossed = tail.first("threshold.crossed")
                if done is None or frozen is None or crossed is None:
                    result.failures.append("the checkpoint was not done: "
                                           + tail.last(MILESTONES))
                    return result, times
                times["crossed"] = crossed[0] - anchor
                times["frozen"] = frozen[0] - anchor
                times["done"] = done[0] - anchor
                times["dump_end"] = times["done"] - float(done[1].get("commit_s", 0.0))
                hog.wait(timeout=30)
                checkpoint_id = str(done[1]["id"])
                call = threading.Thread(target=_restore_call,
                                        args=(first.socket, checkpoint_id, big, times),
                                        daemon=True)
                asked = time.monotonic()
                call.start()
                if phase == "restore":
                    assert offset is not None
                    self._sleep_until(asked + offset)
                    result.seen = "restore called; " + self._kill(first, tail, store)
                    call.join(timeout=30)
                else:
                    call.join(timeout=120)
                    if "restore" in times:
                        times["restore"] -= asked
                    else:
                        result.failures.append(f"restore failed: {times}")
            second = DaemonProcess(store, here / "daemon2.log", "--cgroup", str(cg.path)) \
                if phase is not None else first
            if second is not first:
                daemons.append(second)
                if LogTail(second.log).wait("guard.armed", 60) is None:
                    result.failures.append("the second daemon never armed")
                    return result, times
            self._check(result, store, cg, big, log, second, hog)
            second.stop()
            if _oom_kill_disabled(cg):
                result.failures.append("oom_kill_disable left set after the daemon stopped")
        except Exception as exc:  # a broken point is said, with the others still run
            result.failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            for one in daemons:
                with contextlib.suppress(Exception):
                    one.stop()
            if hog is not None:
                kill_pid(hog.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    hog.wait(timeout=10)
            self._clean(cg, big)
            result.seconds = round(time.monotonic() - began, 2)
            if result.failures:
                keep = self.workdir.parent / f"killdrill-failed-{self.seed}-{index}"
                with contextlib.suppress(OSError):
                    shutil.rmtree(store, ignore_errors=True)  # images: the disk is shared
                    shutil.copytree(here, keep, dirs_exist_ok=True)
                    result.failures.append(f"logs kept in {keep}")
            shutil.rmtree(here, ignore_errors=True)
        return result, times

    def _sleep_until(self, when: float) -> None:
        while (left := when - time.monotonic()) > 0:
            time.sleep(min(left, 0.001) if left < 0.005 else left - 0.004)

    def _kill(self, daemon: DaemonProcess, tail: LogTail, store: Path) -> str:
        daemon.handle.send_signal(signal.SIGKILL)
        daemon.handle.wait()
        # A dump CRIU had begun (its log is there) goes on without the daemon, and must end
        # whole: nothing may stop the task under it (the standby did: the dump failed).
        self.dumping = [p.name[len(PARTIAL_PREFIX):] for p in Store(store).partials()
                        if (p / "images" / "dump.log").exists()]
        return tail.last(MILESTONES)

    # -- after the restart -----------------------------------------------------------------

    def _tasks(self, *cgroups: MemoryCgroup) -> list[int]:
        pids: list[int] = []
        for one in cgroups:
            with contextlib.suppress(Exception):
                pids += one.procs()
        return pids

    def _stopped(self, *cgroups: MemoryCgroup) -> list[str]:
        """Our tasks left stopped, and cgroups left frozen."""
        found = []
        for pid in self._tasks(*cgroups):
            with contextlib.suppress(Exception):
                state = self.proc.state(pid)
                if state in STOPPED:
                    found.append(f"{pid} in state {state}")
        for one in cgroups:
            with contextlib.suppress(OSError):
                if (one.path / "cgroup.freeze").read_text().strip() == "1":
                    found.append(f"{one.path} frozen (cgroup.freeze 1)")
            with contextlib.suppress(OSError):
                freezer = one.path / "freezer.state"
                if freezer.read_text().strip() != "THAWED":
                    found.append(f"{one.path} freezer {freezer.read_text().strip()}")
        return found

    def _settled(self, store: Path, cg: MemoryCgroup, big: MemoryCgroup) -> list[str]:
        """What still waits to be settled (empty once settled)."""
        waits = list(self._stopped(cg, big))
        if Store(store).partials():
            waits.append(f"partial checkpoints left: {[p.name for p in Store(store).partials()]}")
        with contextlib.suppress(Exception):
            if cg.limit() != LIMIT:
                waits.append(f"limit {cg.limit()} is not the configured {LIMIT}")
        ledger = FrozenLedger(store / FROZEN_LEDGER, self.proc, owner=0)
        if ledger.pending():
            waits.append("the frozen ledger still names tasks a dead run stopped")
        return waits

    def _running(self, log: Path, *cgroups: MemoryCgroup) -> bool:
        """The job counts on (in one of its cgroups, not stopped)."""
        if not self._tasks(*cgroups) or self._stopped(*cgroups):
            return False
        mark = last_count(log)
        return bool(wait_until(lambda: last_count(log) > mark or "done" in _text(log), 3))

    def _check(self, result: Point, store: Path, cg: MemoryCgroup, big: MemoryCgroup,
               log: Path, daemon: DaemonProcess, hog: subprocess.Popen[bytes]) -> None:
        # The restarted daemon settles what the killed one left: thawed, caught again, or
        # checkpointed as it was left. Wait until the job is in one steady place.
        def steady() -> bool:
            hog.poll()  # reaped once dumped: CRIU restores its PID
            if self._settled(store, cg, big):
                return False
            if "done" in _text(log):
                return True
            checkpoints = [m for m in Store(store).list() if m.state == "checkpointed"]
            if checkpoints and not self._tasks(cg, big):
                return True
            # Running in the guarded cgroup over its threshold: caught again soon.
            return bool(self._tasks(big)) and self._running(log, big)
        if not wait_until(steady, SETTLE_S, interval=0.05):
            waits = self._settled(store, cg, big)
            result.failures.append(f"not settled within {SETTLE_S:g}s: " + (
                "; ".join(waits) or "the job is neither running in the restore cgroup, done, "
                "nor checkpointed"))
            return
        if "done" in _text(log):
            result.outcome = "finished"
        elif self._tasks(big):
            result.outcome = "ran on (restored)"
        else:
            checkpoints = [m for m in Store(store).list() if m.state == "checkpointed"]
            if len(checkpoints) != 1:
                result.failures.append(f"{len(checkpoints)} checkpoints to restore, not one")
                return
            times: dict[str, float] = {}
            _restore_call(daemon.socket, checkpoints[0].id, big, times)
            if "restore" not in times:
                result.failures.append(f"the checkpoint did not restore: {times}")
                return
            result.outcome = "restored"
        if not wait_until(lambda: "done" in _text(log), 60, interval=0.05):
            state = self._stopped(cg, big)
            result.failures.append(f"the job never ended (last count {last_count(log)}"
                                   f"{'; ' + ', '.join(state) if state else ''})")
            return
        counts = read_counts(log)
        if f"done {COUNT} ok" not in _text(log) or counts != list(range(1, COUNT + 1)):
            result.failures.append(f"the job lost or repeated steps: {_gaps(counts)}; "
                                   f"{_text(log)[-200:]!r}")
        if self._settled(store, cg, big):
            result.failures.append("after the job: " + "; ".join(self._settled(store, cg, big)))
        removed = {str(e.get("id")) for e in daemon.events("checkpoint.partial_removed")}
        ruined = [one for one in self.dumping if one in removed]
        if ruined:
            result.failures.append(f"a dump under way when the daemon was killed failed: "
                                   f"{ruined}")

    def _clean(self, *cgroups: MemoryCgroup) -> None:
        for one in cgroups:
            for pid in self._tasks(one):
                kill_pid(pid)


def _restore_call(socket: Path, checkpoint_id: str, big: MemoryCgroup,
                  times: dict[str, float]) -> None:
    """Restore over the daemon's control socket; times['restore'] is when it answered (or
    times['error'] says why not)."""
    try:
        with ControlClient(socket) as client:
            client.call("Restore", id=checkpoint_id, cgroup=str(big.path))
        times["restore"] = time.monotonic()
    except (OomguardError, OSError) as exc:
        times["error"] = str(exc)  # type: ignore[assignment]


def _oom_kill_disabled(cgroup: MemoryCgroup) -> bool:
    """v1's oom_kill_disable (oomguard sets it while it guards; v2 has none)."""
    try:
        control = (cgroup.path / "memory.oom_control").read_text()
    except OSError:
        return False
    return "oom_kill_disable 1" in control


def _text(log: Path) -> str:
    try:
        return log.read_text()
    except OSError:
        return ""


def _gaps(counts: list[int]) -> str:
    if not counts:
        return "no counts"
    missing = sorted(set(range(1, max(counts) + 1)) - set(counts))
    repeated = sorted(c for c, n in Counter(counts).items() if n > 1)
    return f"last {counts[-1]}, missing {missing[:10]}, repeated {repeated[:10]}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def run(points: int, seed: int, workdir: Path, calibrate: int,
        say: Any = print) -> tuple[list[Point], Phases]:
    rng = random.Random(seed)
    with cgroup_factory("killdrill") as factory:
        drill = Drill(factory, workdir, seed)
        measured: dict[str, list[float]] = {}
        for index in range(calibrate):
            point, times = drill.point(index, None, None)
            if point.failures:
                raise SystemExit(f"calibration run {index} failed (seed {seed}): "
                                 + "; ".join(point.failures))
            for key in ("crossed", "frozen", "dump_end", "done", "restore"):
                measured.setdefault(key, []).append(times[key])
        phases = Phases(**{key: _median(values) for key, values in measured.items()})
        say(f"killdrill: seed {seed}; phases (s from the anchor): {phases}", flush=True)
        results = []
        for number in range(points):
            phase = PHASES[number % len(PHASES)]
            low, high = rng.choice(phases.windows(phase))
            offset = rng.uniform(low, high)
            point, _ = drill.point(calibrate + number, phase, offset)
            results.append(point)
            say(f"point {number + 1}/{points} {phase} +{point.offset_ms:.1f} ms "
                f"(seen: {point.seen}): {point.outcome or '-'}"
                + (f" FAILED: {'; '.join(point.failures)} (seed {seed})"
                   if point.failures else "") + f" [{point.seconds:.1f}s]", flush=True)
    return results, phases


def markdown(report: dict[str, Any]) -> str:
    rows = [("points", report["points"]), ("seed", report["seed"]),
            ("minutes", report["minutes"]), ("points failed", report["failed"])]
    rows += [(f"points in {phase}", report["per_phase"].get(phase, 0)) for phase in PHASES]
    text = "| what | count |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    text += "\nPhase windows (s after the hog's start, a restore's after its call), from " \
            f"the medians of the calibration runs ({report['phases']}):\n\n" \
            "| phase | windows |\n|---|---|\n"
    for phase, spans in report["windows"].items():
        text += f"| {phase} | {', '.join(f'{a:.3f}-{b:.3f}' for a, b in spans)} |\n"
    text += "\nWhere the kill landed (the last event the daemon had logged) and how the job " \
            "went on:\n\n| phase | last event seen | outcome | points |\n|---|---|---|---|\n"
    for (phase, seen, outcome), count in sorted(report["landed"].items()):
        text += f"| {phase} | {seen} | {outcome} | {count} |\n"
    if report["failures"]:
        text += "\nFailures:\n\n" + "".join(f"- {line}\n" for line in report["failures"])
    text += "\nMeasured on:\n\n| what | value |\n|---|---|\n"
    text += "".join(f"| {k} | {v} |\n" for k, v in report.get("machine", {}).items())
    return text


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/killdrill")
    parser.add_argument("--points", type=int, default=200)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--calibrate", type=int, default=3,
                        help="runs not killed, to measure each phase's window")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    if args.points < 1 or args.calibrate < 1:
        parser.error("--points and --calibrate must be at least 1")
    if os.geteuid() != 0:
        parser.error("the kill drill must run as root")
    workdir = args.workdir or Path(subprocess.check_output(
        ["mktemp", "-d", "/var/tmp/oomguard-killdrill.XXXXXX"], text=True).strip())
    began = time.monotonic()
    try:
        results, phases = run(args.points, args.seed, workdir, args.calibrate)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    landed: Counter[tuple[str, str, str]] = Counter(
        (p.phase, p.seen, p.outcome or "failed") for p in results)
    report: dict[str, Any] = {
        "points": len(results), "seed": args.seed,
        "minutes": round((time.monotonic() - began) / 60, 1),
        "failed": sum(1 for p in results if p.failures),
        "per_phase": dict(Counter(p.phase for p in results)),
        "windows": {phase: phases.windows(phase) for phase in PHASES},
        "landed": dict(landed),
        "phases": ", ".join(f"{k} {v:.3f}" for k, v in phases.__dict__.items()),
        "failures": [f"point {p.index} {p.phase} +{p.offset_ms} ms: {'; '.join(p.failures)}"
                     for p in results if p.failures],
        "machine": machine(workdir.parent),
    }
    text = markdown(report)
    print(text)
    if args.out:
        args.out.write_text(text)
    if report["failed"]:
        print(f"killdrill: {report['failed']} of {len(results)} points failed; "
              f"run again with --seed {args.seed}", file=sys.stderr)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
