"""The GPU check behind scripts/gpu-check: a real CUDA job (tests/workloads/gpu_train.py) taken
off the GPU and brought back by oomguard, on a machine with an NVIDIA GPU.

1. reference: the job runs to the end undisturbed; its final checksum is the expectation.
2. vram: oomguard's cuda-checkpoint step (GpuSupport.suspend) frees the job's GPU memory while
   the process lives on in host memory; NVML must show the memory gone; then resume, and the
   job must finish with the reference checksum.
3. checkpoint: `oomguard checkpoint PID` (cuda-checkpoint, then CRIU), NVML must show the memory
   gone and the process too; `oomguard restore ID`; the job must finish with the same checksum.
   Needs a CRIU that works here (`criu check`): skipped, with the reason, where it does not.

Writes gpu-check.json (figures: VRAM freed, seconds) to --out. Exit 0: everything that could
run passed; 1: a check failed; 77: no usable GPU (nothing could run)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "tests" / "workloads" / "gpu_train.py"


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def step_of(log: Path) -> int:
    found = [int(x.split()[0]) for x in lines(log) if x and x[0].isdigit()]
    return found[-1] if found else 0


def done_line(log: Path) -> str | None:
    return next((x for x in lines(log) if x.startswith("done")), None)


def wait(predicate: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


class Check:
    def __init__(self, python: str, work: Path, hold_gib: float, steps: int) -> None:
        self.python, self.work, self.hold_gib, self.steps = python, work, hold_gib, steps
        self.report: dict[str, Any] = {"hold_gib": hold_gib, "steps": steps, "parts": {}}

    def start(self, name: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.work / f"{name}.log"
        proc = subprocess.Popen([self.python, str(WORKLOAD), "--log", str(log), "--hold-gib",
                                 str(self.hold_gib), "--steps", str(self.steps)],
                                stdin=subprocess.DEVNULL, start_new_session=True)
        return proc, log

    def oomguard(self, store: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "oomguard", "--store", str(store),
                               "--log-format", "json", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=600)


def vram_of(gpu: Any, pid: int) -> tuple[int, int]:
    """(the pid's VRAM, the devices' used memory in all), from NVML."""
    snap = gpu.snapshot()
    if snap is None:
        return 0, 0
    return snap.vram_by_pid().get(pid, 0), sum(d.used_bytes for d in snap.devices)


def reference(check: Check) -> str | None:
    proc, log = check.start("reference")
    started = time.monotonic()
    proc.wait(timeout=1800)
    check.report["parts"]["reference"] = {"seconds": round(time.monotonic() - started, 2),
                                          "result": done_line(log)}
    return done_line(log)


def vram_round_trip(check: Check, gpu: Any, expected: str | None) -> bool:
    part: dict[str, Any] = {}
    check.report["parts"]["vram"] = part
    if not gpu.drives_cuda:
        part["skipped"] = f"no cuda-checkpoint: {gpu.why}"
        return True
    proc, log = check.start("vram")
    try:
        wait(lambda: step_of(log) >= 20, 300)
        before, used_before = vram_of(gpu, proc.pid)
        started = time.monotonic()
        gpu.suspend([proc.pid])
        part["suspend_s"] = round(time.monotonic() - started, 3)
        after, used_after = vram_of(gpu, proc.pid)
        part.update(vram_before=before, vram_after=after, device_used_before=used_before,
                    device_used_after=used_after, alive=proc.poll() is None)
        started = time.monotonic()
        gpu.resume([proc.pid])
        part["resume_s"] = round(time.monotonic() - started, 3)
        proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
    part["result"] = done_line(log)
    part["ok"] = bool(before > 0 and after == 0 and part["alive"] and part["result"] == expected)
    return bool(part["ok"])


def checkpoint_round_trip(check: Check, gpu: Any, expected: str | None) -> bool:
    part: dict[str, Any] = {}
    check.report["parts"]["checkpoint"] = part
    criu = check.oomguard(check.work / "store", "doctor")
    if "PASS  criu check" not in criu.stdout:
        part["skipped"] = "CRIU does not work here: " + next(
            (x for x in criu.stdout.splitlines() if "criu" in x), criu.stdout[-300:])
        return True
    if gpu.engine == "none":
        part["skipped"] = f"no engine for CUDA state: {gpu.why}"
        return True
    store = check.work / "store"
    proc, log = check.start("checkpoint")
    restored_pid = None
    try:
        wait(lambda: step_of(log) >= 20, 300)
        before, used_before = vram_of(gpu, proc.pid)
        started = time.monotonic()
        done = check.oomguard(store, "checkpoint", str(proc.pid))
        part["checkpoint_s"] = round(time.monotonic() - started, 3)
        if done.returncode != 0:
            part["error"] = done.stderr[-2000:]
            return False
        proc.wait(timeout=60)
        after, used_after = vram_of(gpu, proc.pid)
        part.update(vram_before=before, vram_after=after, device_used_before=used_before,
                    device_used_after=used_after, step_at_checkpoint=step_of(log))
        started = time.monotonic()
        restored = check.oomguard(store, "restore", done.stdout.strip())
        part["restore_s"] = round(time.monotonic() - started, 3)
        if restored.returncode != 0:
            part["error"] = restored.stderr[-2000:]
            return False
        restored_pid = int(restored.stdout.strip())
        part["result"] = wait(lambda: done_line(log), 1800)
    finally:
        for pid in (proc.pid, restored_pid):
            if pid:
                subprocess.run(["kill", "-9", str(pid)], capture_output=True)
        shutil.rmtree(store, ignore_errors=True)
    part["ok"] = bool(before > 0 and after == 0 and part["result"] == expected)
    return bool(part["ok"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--python", default=sys.executable, help="a Python with PyTorch (CUDA)")
    parser.add_argument("--hold-gib", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from oomguard.gpu.runtime import detect_gpu

    gpu = detect_gpu()
    report_path = args.out / "gpu-check.json"
    args.out.mkdir(parents=True, exist_ok=True)
    if not gpu.accounting:
        print(f"gpu-check: no usable GPU: {gpu.why}", file=sys.stderr)
        report_path.write_text(json.dumps({"skipped": gpu.why}, indent=2))
        return 77
    with tempfile.TemporaryDirectory(prefix="oomguard-gpu-check-") as tmp:
        check = Check(args.python, Path(tmp), args.hold_gib, args.steps)
        snap = gpu.snapshot()
        check.report["gpu"] = {"driver": gpu.driver, "engine": gpu.engine, "why": gpu.why,
                               "devices": [d.name for d in snap.devices] if snap else []}
        expected = reference(check)
        ok = expected is not None
        ok = vram_round_trip(check, gpu, expected) and ok
        ok = checkpoint_round_trip(check, gpu, expected) and ok
        check.report["ok"] = ok
        report_path.write_text(json.dumps(check.report, indent=2) + "\n")
        print(json.dumps(check.report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
