"""What changed in the cgroup filesystem, as the kernel tells it (inotify), so that nothing is
re-read on a timer: a guarded cgroup's limit file written (IN_MODIFY), the setting oomguard
replaced to watch it written by someone else (v2 memory.high: a job scheduler that sets its
own after oomguard set its), a directory created or
removed where a glob rule looks, where a configured cgroup that does not exist yet would
appear, or beside a guarded cgroup (its parent's IN_DELETE: kernfs sends no IN_IGNORED to a
watch inside a removed cgroup).

Where inotify is unavailable the daemon's safety rescan does the same by comparing `stamp`s
(inode and mtime: kernfs updates a file's mtime on every write)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from oomguard.sense.inotify import DIR_ENTRIES, FILE_CHANGES, IN_ONLYDIR, Inotify


@dataclass(frozen=True)
class Stamp:
    """A file's identity and last write: a different one means "read it again"."""

    inode: int
    mtime_ns: int


def stamp(path: Path | str) -> Stamp | None:
    """The file's stamp; None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Stamp(st.st_ino, st.st_mtime_ns)


@dataclass(frozen=True)
class Changes:
    limits: frozenset[str] = frozenset()  # names whose limit file was written
    settings: frozenset[str] = frozenset()  # names whose replaced setting's file was written
    gone: frozenset[str] = frozenset()  # names whose limit file (the cgroup) went away
    directories: frozenset[str] = frozenset()  # watched directories an entry came to or left
    overflow: bool = False  # events were lost: look at everything again

    def __bool__(self) -> bool:
        return bool(self.limits or self.settings or self.gone or self.directories
                    or self.overflow)


def directories_to_watch(pattern: str) -> list[str]:
    """Where a cgroup matching a glob `pattern` would appear: the directory above its first
    wildcard, and every existing directory that matches the pattern down to (not including)
    its last component. /m/slurm/uid_*/job_* watches /m/slurm and each /m/slurm/uid_*."""
    parts = Path(pattern).parts
    first_magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    found = [nearest_existing(str(Path(*parts[:max(1, first_magic)])))]
    for depth in range(first_magic + 1, len(parts)):
        found += [m for m in sorted(glob.glob(str(Path(*parts[:depth])))) if os.path.isdir(m)]
    return found


def nearest_existing(path: str) -> str:
    """`path`, or the nearest of its ancestors that exists (where it would be created)."""
    current = Path(path)
    while not current.is_dir() and current != current.parent:
        current = current.parent
    return str(current)


class FileWatches:
    """Files watched for writes, by name (one cgroup's file, several rules' names): name -> wd
    and wd -> names."""

    def __init__(self) -> None:
        self.wd_of: dict[str, int] = {}
        self.names_of: dict[int, set[str]] = {}

    def add(self, inotify: Inotify, name: str, path: Path) -> bool:
        try:
            wd = inotify.add(path, FILE_CHANGES)
        except OSError:
            return False
        self.wd_of[name] = wd
        self.names_of.setdefault(wd, set()).add(name)
        return True

    def remove(self, name: str) -> int | None:
        """Forget `name`; the wd no name holds any more (for the caller to remove), or None."""
        wd = self.wd_of.pop(name, None)
        if wd is None:
            return None
        names = self.names_of.get(wd, set())
        names.discard(name)
        if names:
            return None
        self.names_of.pop(wd, None)
        return wd

    def ended(self, wd: int) -> None:
        """The file went away: its watch ended with it."""
        for name in self.names_of.pop(wd, set()):
            self.wd_of.pop(name, None)


class CgroupFiles:
    """One inotify instance for every guard. `available` is False (with `why`) where inotify
    cannot be used; then nothing is watched and the safety rescan is all there is."""

    def __init__(self, open_inotify: type[Inotify] = Inotify) -> None:
        self.why: str | None = None
        self._inotify: Inotify | None = None
        try:
            self._inotify = open_inotify()
        except OSError as exc:
            self.why = f"inotify unavailable: {exc.strerror or exc}"
        self._limits = FileWatches()  # each guard's limit file
        self._settings = FileWatches()  # the file of each guard's replaced setting
        self._dir_wd: dict[str, int] = {}  # directory -> wd
        self._dir_of: dict[int, str] = {}

    @property
    def available(self) -> bool:
        return self._inotify is not None

    def fileno(self) -> int | None:
        return self._inotify.fileno() if self._inotify is not None else None

    def watch_limit(self, name: str, limit_file: Path) -> bool:
        """Tell when `limit_file` is written or goes away; False if it cannot be watched."""
        return self._watch(self._limits, name, limit_file)

    def unwatch_limit(self, name: str) -> None:
        self._unwatch(self._limits, name)

    def watch_setting(self, name: str, setting_file: Path) -> bool:
        """Tell when `setting_file` (the setting oomguard replaced) is written; False if it
        cannot be watched."""
        return self._watch(self._settings, name, setting_file)

    def unwatch_setting(self, name: str) -> None:
        self._unwatch(self._settings, name)

    def unwatch(self, name: str) -> None:
        """A guard let go: neither its limit nor its replaced setting is watched any more."""
        self.unwatch_limit(name)
        self.unwatch_setting(name)

    def _watch(self, watches: FileWatches, name: str, path: Path) -> bool:
        if self._inotify is None:
            return False
        self._unwatch(watches, name)
        return watches.add(self._inotify, name, path)

    def _unwatch(self, watches: FileWatches, name: str) -> None:
        wd = watches.remove(name)
        if wd is not None and self._inotify is not None:
            self._inotify.remove(wd)

    def watch_directories(self, directories: set[str]) -> None:
        """Watch exactly these directories for entries coming and going."""
        if self._inotify is None:
            return
        for gone in set(self._dir_wd) - directories:
            wd = self._dir_wd.pop(gone)
            self._dir_of.pop(wd, None)
            if wd not in self._limits.names_of:
                self._inotify.remove(wd)
        for directory in sorted(directories - set(self._dir_wd)):
            try:
                wd = self._inotify.add(directory, DIR_ENTRIES | IN_ONLYDIR)
            except OSError:
                continue  # gone meanwhile: its parent's watch tells when it comes back
            self._dir_wd[directory] = wd
            self._dir_of[wd] = directory

    def watched_directories(self) -> set[str]:
        return set(self._dir_wd)

    def read(self) -> Changes:
        """What the queued events say (non-blocking)."""
        if self._inotify is None:
            return Changes()
        limits: set[str] = set()
        settings: set[str] = set()
        gone: set[str] = set()
        directories: set[str] = set()
        overflow = False
        for event in self._inotify.read():
            if event.overflow:
                overflow = True
                continue
            names = self._limits.names_of.get(event.wd)
            if names is not None:
                (gone if event.gone else limits).update(names)
                if event.gone:
                    self._limits.ended(event.wd)
            written = self._settings.names_of.get(event.wd)
            if written is not None:
                if event.gone:
                    self._settings.ended(event.wd)
                else:
                    settings.update(written)
            directory = self._dir_of.get(event.wd)
            if directory is not None:
                directories.add(directory)
                if event.gone:
                    self._dir_wd.pop(self._dir_of.pop(event.wd), None)
        return Changes(frozenset(limits - gone), frozenset(settings - gone), frozenset(gone),
                       frozenset(directories), overflow)

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
