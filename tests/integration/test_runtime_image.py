"""The container image's root file system (issue 28, item 5): scripts/image builds it offline
from Debian's packages, CRIU and the package of this checkout, and it holds the daemon and CRIU
only. Built for real (mmdebstrap from the Debian archive the host's apt uses), unpacked, and
run in a chroot: the daemon starts its CLI, CRIU loads every library it links and passes
`criu check` against this kernel, and no Slurm, qemu, compiler or test tool is in it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration

IMAGE_BUDGET = 160 << 20  # the gzipped root file system
NOT_IN_A_RUNTIME_IMAGE = ("slurmd", "slurmctld", "munge", "qemu-system-x86", "gcc", "make",
                          "strace", "tmux", "xvfb", "nfs-kernel-server", "mmdebstrap",
                          "python3-pytest", "systemd")


def chroot(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """argv in the unpacked image as a pod runs it (a private mount namespace): its root a
    mount point (CRIU reads mountinfo: a root that is not one has no parent there), /proc and
    /sys of their own, the host's /dev and a tmpfs /run."""
    script = ('mount --bind "$0" "$0" && mount -t proc proc "$0/proc" && '
              'mount -t sysfs sys "$0/sys" && mount --rbind /dev "$0/dev" && '
              'mount -t tmpfs run "$0/run" && exec chroot "$0" "$@"')
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                           str(root), *argv], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def test_the_runtime_image_holds_the_daemon_and_criu_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = subprocess.run([str(REPO / "scripts" / "image"), "--out", str(tmp_path / "dist")],
                           capture_output=True, text=True, timeout=900, cwd=tmp_path,
                           stdin=subprocess.DEVNULL)
    assert built.returncode == 0, built.stderr[-3000:]
    tarball = Path(built.stdout.strip().splitlines()[-1])
    assert tarball == tmp_path / "dist" / "oomguard-rootfs.tar.gz"
    assert tarball.stat().st_size < IMAGE_BUDGET, tarball.stat().st_size
    with capsys.disabled():
        print(f"\n[image] {tarball.stat().st_size / (1 << 20):.1f} MiB gzipped")
    root = tmp_path / "root"
    root.mkdir()
    # GNU tar, as root: owners, modes and device nodes as built (our own build).
    subprocess.run(["tar", "-xzf", str(tarball), "-C", str(root)], check=True, timeout=300)
    try:
        version = chroot(root, "/usr/bin/oomguard", "--version")
        assert version.returncode == 0 and version.stdout.startswith("oomguard "), version
        # Every library CRIU links is there (it would not start otherwise), and it works here.
        criu = chroot(root, "/usr/local/sbin/criu", "check")
        assert criu.returncode == 0 and "Looks good" in criu.stdout + criu.stderr, criu
        # The daemon finds that CRIU on its own, as it would in the pod.
        doctor = chroot(root, "/usr/bin/oomguard", "doctor")
        assert "/usr/local/sbin/criu" in doctor.stdout + doctor.stderr, doctor
        listed = chroot(root, "dpkg-query", "-W", "-f", "${Package}\n")
        assert listed.returncode == 0, listed
        installed = set(listed.stdout.split())
        assert "oomguard" in installed and "python3" in installed
        assert not installed & set(NOT_IN_A_RUNTIME_IMAGE), installed & set(NOT_IN_A_RUNTIME_IMAGE)
        bundled = root / "usr/lib/oomguard/lib"
        for dev_only in ("pytest", "mypy", "ruff", "kubernetes_validate"):
            assert not list(bundled.glob(f"python3*/site-packages/{dev_only}")), dev_only
        assert (root / "var/lib/oomguard").stat().st_mode & 0o077 == 0  # the store: root's
        assert not list((root / "var/lib/apt/lists").glob("*_Packages"))
    finally:
        subprocess.run(["umount", "-R", str(root / "proc")], capture_output=True, check=False)
