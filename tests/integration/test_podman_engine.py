"""A container podman runs, checkpointed by podman when it outgrows its limit, and restored by
podman as a new container (as on another node) that finishes its count with its memory
intact (issue 28, item 4). Real podman 4 with runc and the CRIU scripts/setup provides; the
image is built offline from a rootfs tarball holding one static C program.

Runs in the v2 lane (tests/integration/test_v2_lane.py, part "engine"): on this host's v1
memory controller runc would make cgroups in every v1 hierarchy, outside the test's own, and
crun (which could do without) has no CRIU. Skipped with the reason elsewhere."""

from __future__ import annotations

import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.cgroup.mounts import read_layout
from tests.helpers import REPO, CgroupFactory, MiB, daemon, short_socket_path, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(read_layout().memory_version != 2,
                       reason="podman's runc needs a cgroup v2 memory controller here (this "
                              "host's is v1: runc would write every v1 hierarchy): runs "
                              "inside the VM lane (tests/integration/test_v2_lane.py)"),
]

HOG_SOURCE = REPO / "tests" / "workloads" / "hog.c"
TARGET_MIB, COUNT = 150, 400


def _missing() -> str | None:
    for tool in ("podman", "runc", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup installs it)"
    return None


def _run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr}"
    return done


@pytest.fixture
def podman(tmp_path: Path) -> Iterator[list[str]]:
    """podman's argv with its own storage (vfs on the guest's RAM: the lane's scratch is 9p),
    runc, the cgroupfs manager and a file event log: nothing of the machine's podman used."""
    missing = _missing()
    if missing:
        pytest.skip(missing)
    home = Path(tempfile.mkdtemp(prefix="og-podman-", dir="/run"))
    argv = ["podman", "--root", str(home / "storage"), "--runroot", str(home / "run"),
            "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--runtime", "runc",
            "--events-backend", "file", "--tmpdir", str(home / "tmp")]
    try:
        yield argv
    finally:
        subprocess.run([*argv, "rm", "--force", "--all"], capture_output=True, timeout=300,
                       stdin=subprocess.DEVNULL)
        shutil.rmtree(home, ignore_errors=True)


def _image(podman: list[str], tmp_path: Path) -> str:
    """og-hog:test, from a rootfs tarball of the static hog (no registry, no network)."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "out").mkdir(parents=True)
    _run(["gcc", "-static", "-O1", "-o", str(rootfs / "hog"), str(HOG_SOURCE)])
    tarball = tmp_path / "rootfs.tar"
    _run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."])
    _run([*podman, "import", str(tarball), "og-hog:test"])
    return "og-hog:test"


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_container_is_checkpointed_by_podman_and_restored_as_a_new_one(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, podman: list[str]) -> None:
    image = _image(podman, tmp_path)
    parent = cgroups.make("podman", None)
    out = tmp_path / "out"
    out.mkdir()
    log = out / "hog.log"
    config = tmp_path / "podman.toml"
    command = ", ".join(f'"{part}"' for part in podman)
    config.write_text(f'[podman]\nengine = "on"\ncommand = [{command}]\n\n'
                      f'[[guard]]\ncgroups = ["{parent.path}/libpod-[0-9a-f]*"]\n'
                      f"threshold = 0.75\n")
    with daemon(store, tmp_path / "daemon.log", "--config", str(config)) as guard:
        guard.wait_event("guard.ready", timeout=120)  # the glob matches nothing yet
        cid = _run([*podman, "run", "--detach", "--name", "og1", "--network", "none",
                    "--memory", "160m", "--memory-swap", "160m",
                    "--cgroup-parent", "/" + parent.path.relative_to(parent.mount).as_posix(),
                    "--volume", f"{out}:/out", image,
                    "/hog", "/out/hog.log", str(TARGET_MIB), str(COUNT)]).stdout.strip()
        assert (parent.path / f"libpod-{cid}").is_dir()
        armed = guard.wait_event("guard.armed", timeout=120)[0]  # found as it came
        assert armed["cgroup"] == str(parent.path / f"libpod-{cid}"), armed
        said = guard.wait_event("podman.checkpointed", timeout=600)[0]
        assert said["container_id"] == cid, said
        archive = Path(str(said["archive"]))
    # Podman stopped the container (its memory is free), and keeps it, exited.
    state = _run([*podman, "inspect", "--format", "{{.State.Status}}", "og1"]).stdout.strip()
    assert state == "exited", state
    assert not (parent.path / f"libpod-{cid}").exists() or \
        not (parent.path / f"libpod-{cid}" / "cgroup.procs").read_text().strip()
    assert archive.parent == store / "containers" and archive.is_file()
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    assert not list(archive.parent.glob("*.partial"))
    assert archive.stat().st_size > 4 * MiB
    counted = [line for line in _lines(log) if line.startswith("count")]
    assert counted and not any(line.startswith("done") for line in _lines(log)), _lines(log)[-3:]
    events = [e["event"] for e in guard.events()]
    assert "checkpoint.done" not in events and "oom.kill_seen" not in events, events

    # As on another node: a new container from the archive, under a new name.
    began = time.monotonic()
    _run([*podman, "container", "restore", "--import", str(archive), "--name", "og2"])
    restore_s = time.monotonic() - began
    finished = wait_until(lambda: [x for x in _lines(log) if x.startswith("done")], 600)
    assert finished == [f"done {COUNT} ok"], _lines(log)[-5:]
    numbers = [int(line.split()[1]) for line in _lines(log) if line.startswith("count")]
    print(f"\n[podman] checkpointed by podman in {said['seconds']} s at count {len(counted)}, "
          f"archive {archive.stat().st_size / MiB:.1f} MiB; restored as og2 in {restore_s:.1f} s")
    assert numbers == list(range(1, COUNT + 1)), [n for i, n in enumerate(numbers, 1) if n != i][:5]


def test_a_checkpoint_the_last_daemon_left_half_named_is_kept_by_the_next(
        cgroups: CgroupFactory, store: Path, tmp_path: Path, podman: list[str]) -> None:
    """The daemon died while podman checkpointed its container: podman went on and exported
    the archive under the .partial name the daemon gave it, which only the dead daemon would
    have renamed. Another checkpoint was cut short (a torn archive) while its container ran
    on. The next daemon keeps the first under its name, removes the second, and the first
    container comes back from it, memory intact."""
    image = _image(podman, tmp_path)
    parent = cgroups.make("podmanleft", None)
    out = tmp_path / "out"
    out.mkdir()
    log = out / "hog.log"

    def start(name: str, *argv: str) -> str:
        return _run([*podman, "run", "--detach", "--name", name, "--network", "none",
                     "--memory", "400m", "--cgroup-parent",
                     "/" + parent.path.relative_to(parent.mount).as_posix(),
                     "--volume", f"{out}:/out", image, *argv]).stdout.strip()

    count = 3000  # a minute of counting: the checkpoint comes well before its end
    cid = start("og1", "/hog", "/out/hog.log", "64", str(count))
    live = start("og-live", "/hog", "/out/live.log", "8", "100000")
    assert wait_until(lambda: len(_lines(log)) > 5, 120), _lines(log)
    containers = store / "containers"
    containers.mkdir(parents=True, mode=0o700)
    partial = containers / f"{cid[:12]}-20261207T120000.tar.zst.partial"
    _run([*podman, "container", "checkpoint", "--export", str(partial), "--compress", "zstd",
          cid])  # what the dead daemon's podman went on to do
    torn = containers / f"{live[:12]}-20261207T120001.tar.zst.partial"
    torn.write_bytes(partial.read_bytes()[:65536])  # a checkpoint of og-live, cut short
    counted = len([line for line in _lines(log) if line.startswith("count")])
    sock = short_socket_path()
    config = tmp_path / "podman.toml"
    command = ", ".join(f'"{part}"' for part in podman)
    config.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{sock}"\n\n'
                      f'[podman]\nengine = "on"\ncommand = [{command}]\n')
    with daemon(store, tmp_path / "daemon.log", socket=sock, config=config) as guard:
        kept = guard.wait_event("podman.recovered", timeout=120)[0]
        removed = guard.wait_event("podman.partial_removed", timeout=120)[0]
    archive = containers / f"{cid[:12]}-20261207T120000.tar.zst"
    assert kept["archive"] == str(archive) and "finished" in kept["why"], kept
    assert removed["container_id"] == live[:12] and "running" in removed["why"], removed
    assert sorted(p.name for p in containers.iterdir()) == [archive.name]
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    state = _run([*podman, "inspect", "--format", "{{.State.Status}}", "og-live"]).stdout
    assert state.strip() == "running", state
    _run([*podman, "container", "restore", "--import", str(archive), "--name", "og2"])
    finished = wait_until(lambda: [x for x in _lines(log) if x.startswith("done")], 600)
    assert finished == [f"done {count} ok"], _lines(log)[-5:]
    numbers = [int(line.split()[1]) for line in _lines(log) if line.startswith("count")]
    assert len(numbers) > counted and numbers == list(range(1, count + 1)), \
        [n for i, n in enumerate(numbers, 1) if n != i][:5]
