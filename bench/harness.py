"""What every benchmark needs: cgroups beneath our own, hogs that stamp wall-clock times, the
daemon with its JSON log followed incrementally, the same-run disk baselines and a
description of the machine."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.helpers import (
    HOG,
    REPO,
    CgroupFactory,
    MiB,
    kill_pid,
    oomguard_argv,
    own_memory_cgroup,
    short_socket_path,
)

BENCH_CGROUP_PREFIX = "oomguard-bench"


def cli_result(store: Path, *args: str, socket: Path | None = None) -> tuple[dict[str, Any], str]:
    """`oomguard ARGS` on the store directly, or through the daemon at `socket`: its
    checkpoint.done or restore.done event and its whole stderr. Raises if it failed."""
    argv = oomguard_argv(store, *args) if socket is None else \
        [sys.executable, "-m", "oomguard", "--socket", str(socket), "--log-format", "json", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"oomguard {' '.join(args)} failed: {result.stderr[-2000:]}")
    for line in result.stderr.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") in ("checkpoint.done", "restore.done"):
                return dict(event), result.stderr
    raise RuntimeError(f"no result event from oomguard {' '.join(args)}: {result.stderr[-2000:]}")


def event_time(event: dict[str, Any]) -> float:
    """A daemon event's wall-clock time (structlog's ISO timestamp, UTC)."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile: p95 of 10 runs is the largest, of 20 the 19th."""
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered) - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p95": percentile(values, 0.95),
            "min": min(values), "max": max(values), "n": len(values)}


class EventLog:
    """The daemon's JSON log, read incrementally (the benchmark must not burn the CPU the
    daemon is being measured on by re-parsing the whole file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""
        self.seen: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        new = []
        for line in lines:
            with contextlib.suppress(ValueError):
                if line.startswith(b"{"):
                    new.append(json.loads(line))
        self.seen.extend(new)
        return new

    def wait(self, name: str, timeout: float, where: dict[str, Any] | None = None,
             after: int = 0) -> dict[str, Any]:
        """The first event `name` (matching `where`) at index >= `after` of everything seen."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for event in self.seen[after:]:
                if event.get("event") == name and all(event.get(k) == v
                                                      for k, v in (where or {}).items()):
                    return event
            if time.monotonic() > deadline:
                tail = self.path.read_text()[-3000:] if self.path.exists() else ""
                raise TimeoutError(f"no {name} event within {timeout}s; log tail:\n{tail}")
            time.sleep(0.01)


@dataclass
class Daemon:
    """`oomguard run` on a config file, in the background."""

    store: Path
    config: Path
    log: Path
    socket: Path = field(default_factory=short_socket_path)
    handle: subprocess.Popen[bytes] | None = None

    def start(self) -> EventLog:
        with open(self.log, "ab") as out:
            self.handle = subprocess.Popen(
                oomguard_argv(self.store, "--socket", str(self.socket), "run", "--config",
                              str(self.config)),
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        return EventLog(self.log)

    @property
    def pid(self) -> int:
        assert self.handle is not None
        return self.handle.pid

    def stop(self) -> None:
        if self.handle is not None and self.handle.poll() is None:
            self.handle.terminate()
            try:
                self.handle.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.handle.kill()
                self.handle.wait()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


def guard_config(path: Path, store: Path, cgroups: list[str], **guard: str | bool) -> Path:
    """A config file: the store, and one [[guard]] over `cgroups`."""
    lines = ["[daemon]", f'store = "{store}"', "", "[[guard]]",
             "cgroups = [" + ", ".join(f'"{c}"' for c in cgroups) + "]"]
    for key, value in guard.items():
        lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Hog:
    """tests/workloads/hog.py in a cgroup, its own session, stamping times to a file."""

    proc: subprocess.Popen[bytes]
    stamps: Path
    log: Path

    def marks(self) -> dict[str, dict[str, Any]]:
        """The first mark of each kind; for 'step' (one before each allocation step near the
        crossing), the last."""
        found: dict[str, dict[str, Any]] = {}
        if self.stamps.exists():
            for line in self.stamps.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    mark = json.loads(line)
                    if mark["event"] == "step" and "cross" not in found:
                        found["step"] = mark
                    else:
                        found.setdefault(mark["event"], mark)
        return found

    def kill(self) -> None:
        kill_pid(self.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def start_hog(cgroup_path: Path, work: Path, name: str, *, target_mib: int, rate: float,
              cross_at: int = 0, chunk: int = 2, count: int = 1_000_000,
              children: int = 0) -> Hog:
    stamps = work / f"{name}.stamps"
    log = work / f"{name}.log"
    for path in (stamps, log):
        path.unlink(missing_ok=True)
    argv = [sys.executable, str(HOG), "--log", str(log), "--target", str(target_mib), "--rate",
            str(rate), "--count", str(count), "--tick", "0.05", "--chunk", str(chunk),
            "--children", str(children), "--stamps", str(stamps)]
    if cross_at:
        argv += ["--usage-file", str(cgroup_path / "memory.usage_in_bytes"),
                 "--cross-at", str(cross_at)]
    full = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup_path / "cgroup.procs"),
            *argv]
    proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return Hog(proc, stamps, log)


@contextlib.contextmanager
def cgroup_factory(tag: str) -> Iterator[CgroupFactory]:
    parent = own_memory_cgroup()
    if parent is None or os.geteuid() != 0:
        raise SystemExit("the benchmarks need root and a memory cgroup of their own")
    factory = CgroupFactory(parent=parent, tag=f"{tag}-{os.getpid()}")
    try:
        yield factory
    finally:
        factory.cleanup()


def disk_write(directory: Path, size: int) -> float:
    """Seconds to write `size` bytes sequentially (1 MiB blocks, one repeated byte each, like
    the hogs' pages), fdatasync, and drop the file's page cache: what the disk allows a dump."""
    block = bytes([7]) * MiB
    path = directory / "baseline.bin"
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // MiB):
            os.write(fd, block)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return time.monotonic() - start


def disk_read(directory: Path, keep: bool = False) -> float:
    """Seconds to read back the baseline file with a cold cache (its pages were dropped) into
    one reused buffer; `keep`: leave the file for another read."""
    path = directory / "baseline.bin"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.monotonic()
        while os.read(fd, 4 * MiB):
            pass
        seconds = time.monotonic() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if not keep:
        path.unlink()
    return seconds


def disk_read_into_new_memory(directory: Path) -> float:
    """Seconds to read the baseline file, cold, into memory mapped for it (anonymous, never
    touched), as a restorer must: CRIU's reads its pages with preadv into the restored
    process's fresh mappings. Each new page costs a fault and its zeroing, and on a VM whose
    host hands memory back lazily the host's own first touch as well: the floor of any
    restore that puts the bytes in a process's memory, whoever reads them."""
    path = directory / "baseline.bin"
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(memory)
        start = time.monotonic()
        done = 0
        while done < size:
            count = os.preadv(fd, [view[done:]], done)
            if not count:
                break
            done += count
        seconds = time.monotonic() - start
        view.release()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        memory.close()
        os.close(fd)
    return seconds


def _first_line(path: str, prefix: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return "?"


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                              cwd=REPO).stdout.strip()
    except OSError:
        return "?"


def machine(work: Path) -> dict[str, Any]:
    """What the figures were measured on."""
    from oomguard.act.criu import find_criu, format_version

    try:
        criu = "{} ({})".format(*reversed([format_version(v) if isinstance(v, tuple) else v
                                            for v in find_criu()]))
    except Exception as exc:
        criu = f"not found: {exc}"
    meminfo_kib = int(_first_line("/proc/meminfo", "MemTotal").split()[0])
    df = _run(["df", "--output=source,fstype,size", "-h", str(work)]).splitlines()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kernel": platform.release(),
        "cpu": _first_line("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory_gib": round(meminfo_kib / 1024 / 1024, 1),
        "swap": _first_line("/proc/meminfo", "SwapTotal"),
        "cgroup_memory": "v1" if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
        else "v2",
        "store_filesystem": df[-1] if df else "?",
        "python": platform.python_version(),
        "criu": criu,
        "oomguard_commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "virtual_machine": _run(["systemd-detect-virt", "--vm"]) or "none",
        "container": _run(["systemd-detect-virt", "--container"]) or "none",
    }
