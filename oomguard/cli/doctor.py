"""`oomguard doctor`: is this machine ready? One pass/fail line per requirement, with a hint."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from oomguard.act.criu import Criu, find_criu, format_version
from oomguard.cgroup.mounts import parse_mountinfo, read_layout
from oomguard.gpu.runtime import GpuSupport, detect_gpu
from oomguard.lifecycle.lazyrestore import lazy_unavailable
from oomguard.model.errors import CriuError
from oomguard.model.units import format_size
from oomguard.sense.procevents import EventSource, ProcEvents, Subscriber, process_events_words
from oomguard.sense.psi import has_cap_sys_resource, open_trigger, shortest_window_us, trigger_string
from oomguard.store.checkpoints import Store

PREKILL_SYSTEMD = 260  # systemd-oomd's io.systemd.oom.Prekill hook


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    warn_only: bool = False  # informational: does not fail the doctor

    def line(self) -> str:
        mark = "PASS" if self.ok else ("WARN" if self.warn_only else "FAIL")
        text = f"{mark}  {self.name}: {self.detail}"
        return text + (f"\n      hint: {self.hint}" if self.hint and not self.ok else "")


def parse_kernel_version(release: str) -> tuple[int, int]:
    parts = release.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def running_commands(proc_root: str = "/proc") -> set[str]:
    names = set()
    for entry in Path(proc_root).iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                names.add((entry / "comm").read_text().strip())
    return names


def systemd_version() -> int | None:
    try:
        out = subprocess.run(["systemctl", "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts = out.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def coexistence_checks(running: set[str], systemd: int | None) -> list[Check]:
    """Other OOM guards on the machine, and how oomguard gets to act before they kill."""
    checks = []
    if "systemd-oomd" in running:
        hook = (systemd or 0) >= PREKILL_SYSTEMD
        checks.append(Check(
            "systemd-oomd", hook,
            "running: it kills whole cgroups on PSI/swap pressure; " + (
                f"systemd {systemd} offers the prekill hook: set daemon.oomd_prekill_dir = "
                "\"/run/systemd/oomd.prekill.hook\" so oomguard checkpoints a cgroup before "
                "oomd kills it" if hook else
                f"systemd {systemd} has no prekill hook (>= {PREKILL_SYSTEMD}): give oomguard's "
                "thresholds room to act before oomd's pressure limits"),
            "guard the same cgroups with lower thresholds than oomd's", warn_only=True))
    else:
        checks.append(Check("systemd-oomd", True, "not running", warn_only=True))
    if "earlyoom" in running:
        checks.append(Check(
            "earlyoom", False,
            "running: it SIGTERMs at MemAvailable <= 10% and SIGKILLs at 5% (defaults)",
            "give system rules a min_available above earlyoom's -m (e.g. 15%) so oomguard "
            "checkpoints first", warn_only=True))
    else:
        checks.append(Check("earlyoom", True, "not running", warn_only=True))
    return checks


def filesystem_type(path: Path, proc_root: str = "/proc") -> str | None:
    """The type of the filesystem that holds `path` (or would, for a path not made yet)."""
    probe = path.resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    best: tuple[int, str] | None = None
    for entry in parse_mountinfo((Path(proc_root) / "self" / "mountinfo").read_text()):
        if probe.is_relative_to(entry.mount_point):
            depth = len(entry.mount_point.parts)
            if best is None or depth >= best[0]:
                best = (depth, entry.fstype)
    return best[1] if best else None


KDAT_NAME = b"/criu.kdat"


def kdat_dir(binary: Path) -> str | None:
    """Where this CRIU keeps its kernel probe (criu.kdat; built in as RUNDIR), or None where
    the binary does not say."""
    try:
        data = binary.read_bytes()
    except OSError:
        return None
    at = data.find(KDAT_NAME)
    if at <= 0:
        return None
    start = data.rfind(b"\0", 0, at) + 1
    return data[start:at].decode(errors="replace") or None


def kdat_check(directory: str | None, fs_type: str | None) -> Check:
    """CRIU probes the kernel's features at each start unless it finds them cached, which it
    does only on a tmpfs (cleared at boot)."""
    kept = directory is not None and fs_type == "tmpfs"
    where = f"{directory}/criu.kdat" if directory else "criu.kdat (not found in the binary)"
    return Check("criu probe cache", kept,
                 f"{where} on tmpfs: CRIU starts without probing the kernel" if kept else
                 f"{where} is not on a tmpfs ({fs_type or 'unknown'}): CRIU probes the kernel "
                 "at every start (25-45 ms more per dump and restore on the development VM)",
                 "scripts/setup builds a CRIU that keeps it in /dev/shm where /run is no tmpfs",
                 warn_only=True)


def _seconds(microseconds: int) -> str:
    return f"{microseconds / 1e6:g} s"


def _psi_check(proc_root: Path) -> Check:
    pressure = proc_root / "pressure" / "memory"
    if not pressure.exists():
        return Check("psi", False, "the kernel reports no memory pressure (PSI): system rules "
                     "watch MemAvailable only", "boot with psi=1 (CONFIG_PSI)", warn_only=True)
    try:
        privileged = has_cap_sys_resource((proc_root / "self" / "status").read_text())
    except OSError:
        privileged = False
    window = shortest_window_us(privileged)
    trigger = trigger_string("some", window // 10, window)
    try:
        os.close(open_trigger(pressure, trigger))
    except (OSError, ValueError) as exc:
        return Check("psi", False, f"the kernel refused a memory-pressure trigger ({exc}): "
                     "system rules poll instead", "PSI triggers need write access to the "
                     "pressure files", warn_only=True)
    why = ("CAP_SYS_RESOURCE allows windows from 0.5 s" if privileged
           else "no window under 2 s without CAP_SYS_RESOURCE, which the shipped unit has")
    return Check("psi", True, f"memory-pressure notifications work: the daemon wakes when "
                 f"tasks stall on memory for {_seconds(window // 10)} within {_seconds(window)}; "
                 f"{why}")


def process_events_check(open_events: Callable[[], EventSource] = ProcEvents) -> Check:
    """Can this process subscribe to the kernel's process events (the exact freeze, the
    exit status of restored jobs), or does the freeze re-list /proc, and why."""
    why = Subscriber(open_events).probe()
    return Check("process events", why is None, process_events_words(why),
                 "run oomguard as root in the initial PID, user and network namespaces (not "
                 "inside a container): without the connector a child forked as the tree is "
                 "frozen can escape the freeze, and restored jobs' exit status is unknown",
                 warn_only=True)


NVIDIA_DRIVER_MARKS = ("/proc/driver/nvidia", "/sys/module/nvidia")


def nvidia_driver_loaded(marks: tuple[str, ...] = NVIDIA_DRIVER_MARKS) -> bool:
    return any(Path(mark).exists() for mark in marks)


def gpu_checks(gpu: GpuSupport, driver_loaded: bool | None = None) -> list[Check]:
    """NVML, cuda-checkpoint, CRIU's CUDA plugin, and the GPU actions they allow. A machine
    without an NVIDIA driver gets one line: nothing there can hold GPU memory."""
    loaded = nvidia_driver_loaded() if driver_loaded is None else driver_loaded
    if not gpu.accounting and not loaded:
        waiting = f"; {gpu.tool.binary} waits for one" if gpu.tool is not None else ""
        return [Check("gpu", True, f"none (no NVIDIA driver loaded{waiting})")]
    names = ("nvml", "cuda-checkpoint", "criu cuda plugin", "gpu actions")
    hints = ("pip install nvidia-ml-py (in oomguard's environment) and load the NVIDIA driver",
             "install NVIDIA's cuda-checkpoint (driver >= 550) or set gpu.cuda_checkpoint",
             "optional: CRIU built with its cuda plugin ([gpu] engine = \"criu-plugin\")",
             "")
    return [Check(name, ok, text.split(": ", 1)[1], hint if not ok else "", warn_only=True)
            for name, hint, (ok, text) in zip(names, hints, gpu.lines(), strict=True)]


def run_checks(store: Path, criu_binary: str = "auto", proc_root: str = "/proc",
               gpu: GpuSupport | None = None, gpu_off: bool = False,
               open_events: Callable[[], EventSource] = ProcEvents) -> list[Check]:
    checks = [*_kernel_checks(proc_root, open_events), *_privilege_checks(proc_root),
              *_criu_checks(criu_binary, proc_root)]
    checks.extend(coexistence_checks(running_commands(proc_root), systemd_version()))
    if gpu_off:
        checks.append(Check("gpu", True, "off in the config ([gpu] engine = \"off\")"))
    else:
        checks.extend(gpu_checks(gpu if gpu is not None else detect_gpu()))
    checks.extend(_store_checks(store, proc_root))
    return checks


def _kernel_checks(proc_root: str, open_events: Callable[[], EventSource]) -> list[Check]:
    """The kernel, its cgroups and how oomguard detects pressure on them, PSI, process
    events, memory."""
    checks = []
    release = platform.release()
    kernel = parse_kernel_version(release)
    checks.append(Check("kernel", kernel >= (4, 20), release,
                        "PSI needs >= 4.20; cgroup v2 memory.events oom_kill >= 4.13"))
    layout = read_layout(proc_root)
    mode_detail = {
        "v1": f"cgroup v1, memory controller at {layout.memory_v1}",
        "hybrid": f"hybrid: v1 memory controller at {layout.memory_v1}, "
                  f"v2 tree at {layout.unified} without memory",
        "v2": f"cgroup v2 at {layout.unified} with the memory controller",
        "none": "no memory cgroup controller mounted",
    }[layout.mode]
    checks.append(Check("cgroups", layout.mode != "none", mode_detail,
                        "mount the memory controller (v1) or enable it in cgroup v2"))
    if layout.memory_version == 1 and layout.memory_v1 is not None:
        ok = (layout.memory_v1 / "cgroup.event_control").exists()
        checks.append(Check("detection", ok,
                            "cgroup rules: eventfd thresholds on memory.usage_in_bytes + "
                            "memory.oom_control" if ok else
                            "cgroup.event_control missing: cgroup rules poll",
                            "kernel built without CONFIG_MEMCG v1 events", warn_only=True))
    elif layout.memory_version == 2 and layout.unified is not None:
        has_psi = (layout.unified / "memory.pressure").exists() or any(
            (p / "memory.pressure").exists() for p in layout.unified.iterdir() if p.is_dir())
        checks.append(Check("detection", True,
                            "cgroup rules: memory.high events at the threshold + memory.events "
                            "+ " + ("per-cgroup PSI triggers" if has_psi else "no per-cgroup PSI"),
                            warn_only=True))
    checks.append(_psi_check(Path(proc_root)))
    checks.append(process_events_check(open_events))
    memory = psutil.virtual_memory()
    swap = psutil.swap_memory()
    checks.append(Check("memory", True, f"{format_size(memory.total)} total, "
                        f"{format_size(memory.available)} available, "
                        f"swap {format_size(swap.total)}"))
    return checks


def _privilege_checks(proc_root: str) -> list[Check]:
    checks = [Check("privileges", os.geteuid() == 0,
                    "root" if os.geteuid() == 0 else f"uid {os.geteuid()}",
                    "CRIU dump/restore and cgroup writes need root")]
    try:
        cap_resource = has_cap_sys_resource((Path(proc_root) / "self" / "status").read_text())
    except OSError:
        cap_resource = False
    checks.append(Check("CAP_SYS_RESOURCE", cap_resource,
                        "present: processes of any user can be checkpointed" if cap_resource else
                        "missing: CRIU cannot read other users' rlimits, so only root's own "
                        "processes can be checkpointed",
                        "run the daemon with the full capability set (the shipped unit does)",
                        warn_only=True))
    return checks


def _criu_checks(criu_binary: str, proc_root: str) -> list[Check]:
    checks = []
    try:
        binary, version = find_criu(criu_binary)
        criu = Criu(binary=binary, version=version)
        ok, text = criu.check()
        checks.append(Check("criu", True, f"{binary} version {format_version(version)}"))
        checks.append(Check("criu check", ok, text, "see `criu check --all` for what is missing"))
        cache = kdat_dir(Path(binary))
        checks.append(kdat_check(cache, filesystem_type(Path(cache), proc_root)
                                 if cache else None))
        lazy = lazy_unavailable(criu)
        checks.append(Check("lazy restore", lazy is None,
                            "available (userfaultfd with fork and exit events): "
                            "`oomguard restore --lazy` runs a job before its memory is in"
                            if lazy is None else f"{lazy}: `restore --lazy` restores eagerly",
                            warn_only=True))
    except CriuError as exc:
        checks.append(Check("criu", False, str(exc), "run scripts/setup (builds CRIU 4.2.1)"))
    return checks


def _store_checks(store: Path, proc_root: str) -> list[Check]:
    checks = []
    fs_type = filesystem_type(store, proc_root)
    if fs_type in ("tmpfs", "ramfs"):
        checks.append(Check("store filesystem", False, f"{store} is on {fs_type}",
                            "images on a RAM filesystem free no memory: put the store on disk",
                            warn_only=True))
    st = Store(store)
    if store.exists():
        mode = store.stat().st_mode & 0o777
        checks.append(Check("store", mode & 0o077 == 0, f"{store} mode {mode:o}",
                            f"chmod 700 {store}: images hold every secret of a process"))
    else:
        checks.append(Check("store", True, f"{st.root} (created on first checkpoint, mode 700)"))
    return checks
