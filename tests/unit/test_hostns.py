"""oomguard.act.hostns: when CRIU is run in another mount namespace, and when not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from oomguard.act.hostns import host_mount_prefix


def fake_proc(tmp_path: Path, same_ns: bool, same_binary: bool) -> Path:
    """/proc with our namespace file and PID 1's (one file if `same_ns`), and PID 1's root:
    this machine's / (so its CRIU is ours) or an empty directory (a container's own)."""
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "1" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "mnt").write_text("ours")
    if same_ns:
        os.link(proc / "self" / "ns" / "mnt", proc / "1" / "ns" / "mnt")
    else:
        (proc / "1" / "ns" / "mnt").write_text("host")
    empty = tmp_path / "container-root"
    empty.mkdir()
    (proc / "1" / "root").symlink_to("/" if same_binary else empty)
    return proc


def test_a_sandboxed_daemon_runs_criu_in_the_hosts_namespace(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, same_ns=False, same_binary=True)
    binary = shutil.which("sh") or "/bin/sh"
    assert host_mount_prefix(binary, "auto", proc) == (
        shutil.which("nsenter"), f"--mount={proc / '1' / 'ns' / 'mnt'}", "--")
    assert host_mount_prefix(binary, "off", proc) == ()
    named = str(proc / "1" / "ns" / "mnt")
    assert host_mount_prefix(binary, named, proc)[1] == f"--mount={named}"


def test_no_prefix_in_the_same_namespace_or_for_another_file_system(tmp_path: Path) -> None:
    binary = shutil.which("sh") or "/bin/sh"
    same = fake_proc(tmp_path / "a", same_ns=True, same_binary=True)
    assert host_mount_prefix(binary, "auto", same) == ()
    container = fake_proc(tmp_path / "b", same_ns=False, same_binary=False)
    assert host_mount_prefix(binary, "auto", container) == ()  # not the same CRIU there
    assert host_mount_prefix(binary, "auto", tmp_path / "no-proc") == ()  # unreadable


def test_no_prefix_where_the_store_is_another_directory_there(tmp_path: Path) -> None:
    """CRIU writes the images where the daemon then sums them: never through another mount of
    the store (an NFS export mounted again in the daemon's namespace)."""
    proc = fake_proc(tmp_path, same_ns=False, same_binary=False)
    there = tmp_path / "container-root"
    binary = tmp_path / "criu"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (there / str(tmp_path).lstrip("/")).mkdir(parents=True)
    os.link(binary, there / str(binary).lstrip("/"))  # the very same CRIU there
    store = tmp_path / "store"
    store.mkdir()
    assert host_mount_prefix(str(binary), "auto", proc)[0] == shutil.which("nsenter")
    (there / str(store).lstrip("/")).mkdir()  # another directory at the store's path there
    assert host_mount_prefix(str(binary), "auto", proc, store=store) == ()
    # Not made yet: its nearest existing parent decides (here another directory too).
    assert host_mount_prefix(str(binary), "auto", proc, store=store / "new" / "x") == ()


def test_the_prefix_stays_where_the_store_is_the_same_directory_there(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, same_ns=False, same_binary=True)  # PID 1's root: this /
    binary = shutil.which("sh") or "/bin/sh"
    store = tmp_path / "store"
    store.mkdir()
    assert host_mount_prefix(binary, "auto", proc, store=store)[0] == shutil.which("nsenter")
    assert host_mount_prefix(binary, "auto", proc, store=store / "not-yet")[0] \
        == shutil.which("nsenter")
