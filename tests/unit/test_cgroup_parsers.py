"""oomguard.cgroup: flat-keyed files, memory.max, mountinfo, layouts, open_cgroup, snapshots."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from oomguard.cgroup.base import MemorySnapshot, parse_flat_keyed, parse_procs, read_int_file
from oomguard.cgroup.mounts import (
    CgroupLayout,
    MountEntry,
    layout_from_mounts,
    open_cgroup,
    parse_mountinfo,
    read_layout,
)
from oomguard.cgroup.v1 import V1_UNLIMITED_FLOOR, V1MemoryCgroup
from oomguard.cgroup.v2 import V2MemoryCgroup, parse_max
from oomguard.model.errors import CgroupGone
from tests.unit._support import FIXTURES, fixture_text

V1_UNLIMITED = 9223372036854771712  # PAGE_COUNTER_MAX * 4096, what v1 prints for "no limit"

# -- parse_flat_keyed ----------------------------------------------------------------------------


def test_parse_flat_keyed_v1_memory_stat() -> None:
    text = fixture_text("v1", "memory.stat")
    stat = parse_flat_keyed(text)
    assert len(stat) == len(text.splitlines()) == 36
    assert stat["total_rss"] == 201326592
    assert stat["total_cache"] == 6291456
    assert stat["rss"] == 50331648
    assert stat["rss_huge"] == 41943040
    assert stat["total_rss_huge"] == 167772160
    assert stat["cache"] == 2162688
    assert stat["hierarchical_memory_limit"] == 268435456
    assert stat["hierarchical_memsw_limit"] == V1_UNLIMITED
    assert stat["pgmajfault"] == 3


def test_parse_flat_keyed_v1_oom_control() -> None:
    assert parse_flat_keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3") == {
        "oom_kill_disable": 0, "under_oom": 0, "oom_kill": 3}
    assert parse_flat_keyed(fixture_text("v1", "memory.oom_control.under_oom")) == {
        "oom_kill_disable": 1, "under_oom": 1, "oom_kill": 0}


def test_parse_flat_keyed_v2_memory_stat() -> None:
    text = fixture_text("v2", "memory.stat")
    stat = parse_flat_keyed(text)
    assert stat["anon"] == 188743680
    assert stat["file"] == 12582912
    assert stat["anon_thp"] == 142606336
    assert stat["slab"] == 1523712
    assert stat["thp_swpout_fallback"] == 0
    assert len(stat) == len(text.splitlines()) == 56


def test_parse_flat_keyed_v2_memory_events() -> None:
    assert parse_flat_keyed(fixture_text("v2", "memory.events")) == {
        "low": 0, "high": 0, "max": 57, "oom": 2, "oom_kill": 2, "oom_group_kill": 0}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("\n\n", {}),
        ("a 1\n\nb 2\n", {"a": 1, "b": 2}),
        ("a 1\nb\n", {"a": 1}),  # a key without value is skipped
        ("a x\nb 2\n", {"b": 2}),  # a non-integer value is skipped
        ("a 1\na 2\n", {"a": 2}),  # the last one wins
        ("a 1 \n", {"a": 1}),  # trailing whitespace
        ("a -1\n", {"a": -1}),
        ("a 1 2\n", {}),  # nested keyed (memory.numa_stat style) lines are not flat
    ],
    ids=["empty", "blank", "blank-line", "no-value", "non-int", "dup", "trailing-ws", "negative",
         "nested"],
)
def test_parse_flat_keyed_edge_cases(text: str, expected: dict[str, int]) -> None:
    assert parse_flat_keyed(text) == expected


def test_parse_procs_and_read_int_file(tmp_path: Path) -> None:
    assert parse_procs("12\n345\n6789\n") == [12, 345, 6789]
    assert parse_procs("") == []
    (tmp_path / "n").write_text("42\n")
    assert read_int_file(tmp_path / "n") == 42


# -- parse_max -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max\n", None),
        ("max", None),
        ("  max  \n", None),
        ("268435456\n", 268435456),
        ("0\n", 0),
        ("4096", 4096),
        ("9223372036854771712\n", V1_UNLIMITED),
    ],
)
def test_parse_max(text: str, expected: int | None) -> None:
    assert parse_max(text) == expected


@pytest.mark.parametrize("text", ["", "MAX", "1G", "infinity"])
def test_parse_max_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_max(text)


# -- parse_mountinfo -----------------------------------------------------------------------------

def test_parse_mountinfo_v1_fixture() -> None:
    entries = parse_mountinfo(fixture_text("mountinfo", "v1"))
    assert len(entries) == 8
    memory = [e for e in entries if e.fstype == "cgroup" and "memory" in e.super_options]
    assert memory == [MountEntry(Path("/sys/fs/cgroup/memory"), "cgroup", ("rw", "memory"))]
    systemd = next(e for e in entries if e.mount_point == Path("/sys/fs/cgroup/systemd"))
    assert systemd.super_options == ("rw", "xattr", "name=systemd")
    cpu = next(e for e in entries if e.mount_point == Path("/sys/fs/cgroup/cpu,cpuacct"))
    assert cpu.super_options == ("rw", "cpu", "cpuacct")
    assert entries[0] == MountEntry(Path("/"), "ext4", ("rw", "errors=remount-ro"))


def test_parse_mountinfo_cgroup2() -> None:
    entries = parse_mountinfo(fixture_text("mountinfo", "v2"))
    cg2 = [e for e in entries if e.fstype == "cgroup2"]
    assert cg2 == [MountEntry(Path("/sys/fs/cgroup"), "cgroup2",
                              ("rw", "nsdelegate", "memory_recursiveprot"))]


@pytest.mark.parametrize(
    ("line", "mount_point"),
    [
        (r"40 22 0:40 / /mnt/my\040cgroups rw,relatime shared:20 - cgroup cgroup rw,memory",
         "/mnt/my cgroups"),
        (r"40 22 0:40 / /mnt/tab\011x rw - cgroup2 cgroup2 rw", "/mnt/tab\tx"),
        (r"40 22 0:40 / /mnt/nl\012x rw - cgroup2 cgroup2 rw", "/mnt/nl\nx"),
        (r"40 22 0:40 / /mnt/back\134slash rw - cgroup2 cgroup2 rw", "/mnt/back\\slash"),
        # a literal backslash followed by "040" must not turn into a space
        (r"40 22 0:40 / /mnt/a\134040b rw - cgroup2 cgroup2 rw", "/mnt/a\\040b"),
        # no optional fields before the separator
        ("40 22 0:40 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw", "/sys/fs/cgroup"),
        # several optional fields
        ("40 22 0:40 / /x rw shared:3 master:1 propagate_from:2 - cgroup cgroup rw,memory", "/x"),
    ],
    ids=["space", "tab", "newline", "backslash", "backslash-040", "no-optional", "many-optional"],
)
def test_parse_mountinfo_escapes_and_optional_fields(line: str, mount_point: str) -> None:
    [entry] = parse_mountinfo(line + "\n")
    assert entry.mount_point == Path(mount_point)


@pytest.mark.parametrize(
    "text",
    ["", "garbage\n", "40 22 0:40 / /x rw shared:3\n", "40 22 / - cgroup cgroup rw\n",
     "40 22 0:40 / /x rw - cgroup\n"],
    ids=["empty", "garbage", "no-separator", "short-left", "short-right"],
)
def test_parse_mountinfo_skips_malformed(text: str) -> None:
    assert parse_mountinfo(text) == []


# -- layout_from_mounts / CgroupLayout -----------------------------------------------------------

@pytest.mark.parametrize(
    ("fixture", "controllers", "mode", "version", "memory_mount", "unified"),
    [
        ("v1", (), "v1", 1, "/sys/fs/cgroup/memory", None),
        ("hybrid", (), "hybrid", 1, "/sys/fs/cgroup/memory", "/sys/fs/cgroup/unified"),
        ("v2", ("cpuset", "cpu", "io", "memory", "pids"), "v2", 2, "/sys/fs/cgroup",
         "/sys/fs/cgroup"),
        # a cgroup2 tree whose root does not offer the memory controller: nothing to guard
        ("v2", ("cpu", "io", "pids"), "none", None, None, "/sys/fs/cgroup"),
    ],
    ids=["v1", "hybrid", "v2", "v2-no-memory"],
)
def test_layout_modes(fixture: str, controllers: tuple[str, ...], mode: str, version: int | None,
                      memory_mount: str | None, unified: str | None) -> None:
    layout = layout_from_mounts(parse_mountinfo(fixture_text("mountinfo", fixture)), controllers)
    assert layout.mode == mode
    assert layout.memory_version == version
    assert layout.memory_mount == (Path(memory_mount) if memory_mount else None)
    assert layout.unified == (Path(unified) if unified else None)


def test_layout_none_without_cgroup_mounts() -> None:
    layout = layout_from_mounts(parse_mountinfo("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"),
                                ("memory",))
    assert layout == CgroupLayout(memory_v1=None, unified=None, unified_controllers=())
    assert (layout.mode, layout.memory_version, layout.memory_mount) == ("none", None, None)


def test_layout_ignores_controllers_without_unified_mount() -> None:
    layout = layout_from_mounts(parse_mountinfo(fixture_text("mountinfo", "v1")), ("memory",))
    assert layout.unified_controllers == ()
    assert not layout.unified_has_memory


def test_layout_first_memory_mount_wins() -> None:
    text = (fixture_text("mountinfo", "v1")
            + "50 22 0:26 / /mnt/memory-again rw - cgroup cgroup rw,memory\n")
    layout = layout_from_mounts(parse_mountinfo(text), ())
    assert layout.memory_v1 == Path("/sys/fs/cgroup/memory")


def test_layout_memory_recursiveprot_is_not_memory() -> None:
    # The cgroup2 super option memory_recursiveprot does not mean the memory controller is there.
    layout = layout_from_mounts(parse_mountinfo(fixture_text("mountinfo", "v2")), ())
    assert layout.mode == "none"


def test_read_layout_from_fake_proc(tmp_path: Path) -> None:
    cgroot = tmp_path / "cgroup"
    cgroot.mkdir()
    (cgroot / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(
        f"35 24 0:30 / {cgroot} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    layout = read_layout(tmp_path / "proc")
    assert layout.mode == "v2"
    assert layout.memory_mount == cgroot
    assert "memory" in layout.unified_controllers


def test_read_layout_unreadable_controllers(tmp_path: Path) -> None:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(
        f"35 24 0:30 / {tmp_path / 'absent'} rw - cgroup2 cgroup2 rw\n")
    layout = read_layout(tmp_path / "proc")
    assert layout.mode == "none"
    assert layout.unified == tmp_path / "absent"


# -- open_cgroup ---------------------------------------------------------------------------------

V1_LAYOUT = CgroupLayout(memory_v1=Path("/sys/fs/cgroup/memory"), unified=None, unified_controllers=())
HYBRID_LAYOUT = CgroupLayout(memory_v1=Path("/sys/fs/cgroup/memory"),
                             unified=Path("/sys/fs/cgroup/unified"), unified_controllers=())
V2_LAYOUT = CgroupLayout(memory_v1=None, unified=Path("/sys/fs/cgroup"),
                         unified_controllers=("cpu", "memory", "pids"))
NONE_LAYOUT = CgroupLayout(memory_v1=None, unified=Path("/sys/fs/cgroup"),
                           unified_controllers=("cpu",))


@pytest.mark.parametrize(
    ("layout", "path", "cls", "fs_path", "rel_path"),
    [
        (V1_LAYOUT, "/sys/fs/cgroup/memory/jobs/build", V1MemoryCgroup,
         "/sys/fs/cgroup/memory/jobs/build", "/jobs/build"),
        (V1_LAYOUT, "/jobs/build", V1MemoryCgroup, "/sys/fs/cgroup/memory/jobs/build", "/jobs/build"),
        (V1_LAYOUT, "/", V1MemoryCgroup, "/sys/fs/cgroup/memory", "/"),
        (V1_LAYOUT, "/sys/fs/cgroup/memory", V1MemoryCgroup, "/sys/fs/cgroup/memory", "/"),
        (V1_LAYOUT, Path("/jobs/x/"), V1MemoryCgroup, "/sys/fs/cgroup/memory/jobs/x", "/jobs/x"),
        (HYBRID_LAYOUT, "/jobs", V1MemoryCgroup, "/sys/fs/cgroup/memory/jobs", "/jobs"),
        (V2_LAYOUT, "/sys/fs/cgroup/user.slice/job", V2MemoryCgroup,
         "/sys/fs/cgroup/user.slice/job", "/user.slice/job"),
        (V2_LAYOUT, "/user.slice/job", V2MemoryCgroup, "/sys/fs/cgroup/user.slice/job",
         "/user.slice/job"),
        # a sibling of the mount point whose name merely starts with it is a hierarchy path
        (V1_LAYOUT, "/sys/fs/cgroup/memory-x", V1MemoryCgroup,
         "/sys/fs/cgroup/memory/sys/fs/cgroup/memory-x", "/sys/fs/cgroup/memory-x"),
    ],
    ids=["v1-fs", "v1-hier", "v1-root", "v1-mount", "v1-trailing-slash", "hybrid", "v2-fs",
         "v2-hier", "prefix-sibling"],
)
def test_open_cgroup_resolution(layout: CgroupLayout, path: str | Path, cls: type, fs_path: str,
                                rel_path: str) -> None:
    cg = open_cgroup(path, layout)
    assert type(cg) is cls
    assert cg.version == (1 if cls is V1MemoryCgroup else 2)
    assert cg.path == Path(fs_path)
    assert cg.rel_path == rel_path


@pytest.mark.parametrize("path", ["jobs/build", "memory/jobs", ".", ""])
def test_open_cgroup_relative_path(path: str) -> None:
    with pytest.raises(ValueError, match="must be absolute"):
        open_cgroup(path, V1_LAYOUT)


def test_open_cgroup_without_memory_controller() -> None:
    with pytest.raises(ValueError, match="no memory cgroup controller"):
        open_cgroup("/jobs", NONE_LAYOUT)


def test_child_keeps_mount() -> None:
    cg = open_cgroup("/jobs", V1_LAYOUT).child("build")
    assert (cg.path, cg.rel_path) == (Path("/sys/fs/cgroup/memory/jobs/build"), "/jobs/build")
    cg2 = open_cgroup("/", V2_LAYOUT).child("oomguard")
    assert (cg2.path, cg2.rel_path) == (Path("/sys/fs/cgroup/oomguard"), "/oomguard")


# -- snapshots against fake cgroup directories ---------------------------------------------------

def _v1_dir(root: Path, *, limit: str = "memory.limit_in_bytes",
            oom: str = "memory.oom_control") -> Path:
    cg = root / "memory" / "jobs"
    cg.mkdir(parents=True)
    for name, src in (("memory.usage_in_bytes", "memory.usage_in_bytes"),
                      ("memory.limit_in_bytes", limit), ("memory.stat", "memory.stat"),
                      ("memory.oom_control", oom)):
        shutil.copy(FIXTURES / "v1" / src, cg / name)
    (cg / "cgroup.procs").write_text("4242\n4243\n")
    return cg


def _v2_dir(root: Path, *, limit: str = "memory.max") -> Path:
    cg = root / "unified" / "jobs"
    cg.mkdir(parents=True)
    for name, src in (("memory.current", "memory.current"), ("memory.max", limit),
                      ("memory.stat", "memory.stat"), ("memory.events", "memory.events")):
        shutil.copy(FIXTURES / "v2" / src, cg / name)
    (cg / "cgroup.procs").write_text("5001\n")
    return cg


def test_v1_snapshot(tmp_path: Path) -> None:
    cg = V1MemoryCgroup(_v1_dir(tmp_path), tmp_path / "memory")
    assert cg.rel_path == "/jobs"
    assert cg.exists()
    snap = cg.snapshot()
    assert snap == MemorySnapshot(
        usage_bytes=209715200, limit_bytes=268435456,
        anon_bytes=201326592,  # total_rss (hierarchical), not rss
        file_bytes=6291456,  # total_cache
        oom_kills=3, under_oom=False)
    assert snap.usage_fraction == pytest.approx(0.78125)
    assert snap.anon_fraction == pytest.approx(0.75)
    assert cg.procs() == [4242, 4243]


def test_v1_snapshot_unlimited_and_under_oom(tmp_path: Path) -> None:
    cg = V1MemoryCgroup(_v1_dir(tmp_path, limit="memory.limit_in_bytes.unlimited",
                                oom="memory.oom_control.under_oom"), tmp_path / "memory")
    snap = cg.snapshot()
    assert snap.limit_bytes is None
    assert snap.under_oom
    assert snap.oom_kills == 0
    assert snap.usage_fraction is None
    assert snap.anon_fraction is None


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        ("9223372036854771712\n", None),  # x86-64, 4 KiB pages
        ("9223372036854710272\n", None),  # 64 KiB pages (arm64/ppc64)
        (f"{V1_UNLIMITED_FLOOR}\n", None),
        (f"{V1_UNLIMITED_FLOOR - 4096}\n", V1_UNLIMITED_FLOOR - 4096),
        ("104857600\n", 104857600),
    ],
)
def test_v1_limit_values(tmp_path: Path, limit: str, expected: int | None) -> None:
    path = _v1_dir(tmp_path)
    (path / "memory.limit_in_bytes").write_text(limit)
    assert V1MemoryCgroup(path, tmp_path / "memory").limit() == expected


def test_v1_snapshot_falls_back_to_local_counters(tmp_path: Path) -> None:
    """Without hierarchical total_* lines (use_hierarchy off on old kernels), rss/cache are used."""
    path = _v1_dir(tmp_path)
    (path / "memory.stat").write_text("cache 1000\nrss 2000\nrss_huge 0\n")
    (path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")  # < 4.13: no oom_kill
    snap = V1MemoryCgroup(path, tmp_path / "memory").snapshot()
    assert (snap.anon_bytes, snap.file_bytes, snap.oom_kills) == (2000, 1000, 0)


def test_v1_set_limit_writes(tmp_path: Path) -> None:
    path = _v1_dir(tmp_path)
    cg = V1MemoryCgroup(path, tmp_path / "memory")
    cg.set_limit(512 << 20)
    assert (path / "memory.limit_in_bytes").read_text() == str(512 << 20)
    cg.set_limit(None)
    assert (path / "memory.limit_in_bytes").read_text() == "-1"


def test_v2_snapshot(tmp_path: Path) -> None:
    cg = V2MemoryCgroup(_v2_dir(tmp_path), tmp_path / "unified")
    assert cg.rel_path == "/jobs"
    assert cg.exists()
    snap = cg.snapshot()
    assert snap == MemorySnapshot(usage_bytes=203816960, limit_bytes=268435456,
                                  anon_bytes=188743680, file_bytes=12582912, oom_kills=2,
                                  under_oom=False, high_events=0, max_events=57)
    assert cg.events()["max"] == 57
    assert cg.procs() == [5001]


def test_v2_snapshot_unlimited(tmp_path: Path) -> None:
    cg = V2MemoryCgroup(_v2_dir(tmp_path, limit="memory.max.unlimited"), tmp_path / "unified")
    snap = cg.snapshot()
    assert snap.limit_bytes is None
    assert snap.usage_fraction is None


def test_v2_set_limit_writes(tmp_path: Path) -> None:
    path = _v2_dir(tmp_path)
    cg = V2MemoryCgroup(path, tmp_path / "unified")
    cg.set_limit(1 << 30)
    assert (path / "memory.max").read_text() == str(1 << 30)
    assert cg.limit() == 1 << 30
    cg.set_limit(None)
    assert (path / "memory.max").read_text() == "max"
    assert cg.limit() is None


def test_v2_missing_directory_is_cgroup_gone(tmp_path: Path) -> None:
    cg = V2MemoryCgroup(tmp_path / "unified" / "gone", tmp_path / "unified")
    assert not cg.exists()
    for call in (cg.snapshot, cg.limit, cg.events, cg.procs, lambda: cg.set_limit(1),
                 lambda: cg.add_proc(1)):
        with pytest.raises(CgroupGone):
            call()


def test_v2_removed_while_watched(tmp_path: Path) -> None:
    path = _v2_dir(tmp_path)
    cg = V2MemoryCgroup(path, tmp_path / "unified")
    cg.snapshot()
    shutil.rmtree(path)
    with pytest.raises(CgroupGone):
        cg.snapshot()


def test_v1_missing_directory_files_read_directly(tmp_path: Path) -> None:
    """The files oomguard reads itself (memory.stat, memory.oom_control, cgroup.procs) say gone."""
    cg = V1MemoryCgroup(tmp_path / "memory" / "gone", tmp_path / "memory")
    assert not cg.exists()
    for call in (cg.stat, cg.oom_control, cg.procs, lambda: cg.set_limit(1), lambda: cg.add_proc(1)):
        with pytest.raises(CgroupGone):
            call()


def test_v1_missing_directory_snapshot_is_cgroup_gone(tmp_path: Path) -> None:
    cg = V1MemoryCgroup(tmp_path / "memory" / "gone", tmp_path / "memory")
    with pytest.raises(CgroupGone):
        cg.snapshot()


def test_v1_removed_while_watched(tmp_path: Path) -> None:
    path = _v1_dir(tmp_path)
    cg = V1MemoryCgroup(path, tmp_path / "memory")
    cg.snapshot()
    shutil.rmtree(path)
    with pytest.raises(CgroupGone):
        cg.limit()
