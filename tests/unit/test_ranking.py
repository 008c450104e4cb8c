"""oomguard.sense.ranking: the standing ranking of processes by resident memory that system
rules read at the crossing instead of every process (a fake /proc of kernel-format files)."""

from __future__ import annotations

from pathlib import Path

from oomguard.sense.ranking import MAX_AGE, ProcessRanking, Ranking, read_brief

PAGE = 4096


def add(proc: Path, pid: int, ppid: int, rss_pages: int, *, start: int = 100,
        flags: int = 0, comm: str = "job") -> None:
    base = proc / str(pid)
    base.mkdir(parents=True)
    fields = ["S", str(ppid), str(pid), str(pid), "0", "-1", str(flags)] + ["0"] * 12 \
        + [str(start)] + ["0"] * 10
    (base / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    (base / "statm").write_text(f"{rss_pages * 2} {rss_pages} 10 1 0 {rss_pages} 0\n")


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_read_brief_skips_kernel_threads_and_the_gone(tmp_path: Path) -> None:
    add(tmp_path, 10, 1, 256)
    add(tmp_path, 11, 2, 0, comm="kworker/0:1")  # a kernel thread (child of kthreadd)
    add(tmp_path, 12, 0, 0, flags=0x00200000, comm="kthreadd")
    brief = read_brief(tmp_path, 10, PAGE)
    assert brief is not None and brief.rss_bytes == 256 * PAGE and brief.ppid == 1
    assert read_brief(tmp_path, 11, PAGE) is None and read_brief(tmp_path, 12, PAGE) is None
    assert read_brief(tmp_path, 99, PAGE) is None


def test_ranking_largest_first_with_families(tmp_path: Path) -> None:
    add(tmp_path, 1, 0, 100)
    add(tmp_path, 20, 1, 5000, start=300)  # a big job...
    add(tmp_path, 21, 20, 10)  # ...its children
    add(tmp_path, 22, 21, 10)
    for pid in range(100, 140):  # many small ones
        add(tmp_path, pid, 1, 50)
    ranking = ProcessRanking(tmp_path, clock=Clock(), page_size=PAGE).refresh()
    assert ranking.top(2) == [20, 1]
    assert ranking.family([20]) == [20, 21, 22]
    assert len(ranking.processes) == 44


def test_to_read_is_the_top_and_the_newcomers(tmp_path: Path) -> None:
    add(tmp_path, 1, 0, 1)
    add(tmp_path, 20, 1, 5000)
    add(tmp_path, 21, 20, 1)
    for pid in range(100, 200):
        add(tmp_path, pid, 1, 2)
    started: list[int] = []
    ranker = ProcessRanking(tmp_path, clock=Clock(), page_size=PAGE,
                            newcomers=lambda since: list(started))
    ranking = ranker.refresh()
    add(tmp_path, 500, 1, 9999)  # started after the ranking was taken...
    second = ranking.top(2)[1]
    assert ranker.to_read(ranking, count=2) == [20, second]  # ...unknown without events
    started.append(500)  # ...named by the process events
    assert ranker.to_read(ranking, count=2) == [20, second, 500]  # not the hundred small


def test_a_refresh_reads_stat_only_of_processes_it_has_not_seen(tmp_path: Path) -> None:
    add(tmp_path, 1, 0, 1)
    add(tmp_path, 30, 1, 10)
    ranker = ProcessRanking(tmp_path, clock=Clock(), page_size=PAGE)
    ranker.refresh()
    (tmp_path / "30" / "stat").unlink()  # a second refresh does not need it
    (tmp_path / "30" / "statm").write_text("40 20 1 1 0 20 0\n")
    again = ranker.refresh()
    assert again.top(1) == [30] and again.processes[0].rss_bytes == 20 * PAGE


def test_an_old_ranking_is_not_used(tmp_path: Path) -> None:
    add(tmp_path, 1, 0, 1)
    clock = Clock()
    ranker = ProcessRanking(tmp_path, clock=clock, page_size=PAGE)
    assert ranker.current() is None
    ranker.refresh()
    assert isinstance(ranker.current(), Ranking)
    clock.now += MAX_AGE + 0.1
    assert ranker.current() is None


def test_prepare_refreshes_in_the_background_at_most_every_five_seconds(tmp_path: Path) -> None:
    add(tmp_path, 1, 0, 1)
    clock = Clock()
    ranker = ProcessRanking(tmp_path, clock=clock, page_size=PAGE)
    ranker.prepare()
    assert ranker._thread is not None
    ranker._thread.join(10)
    first = ranker.current()
    assert first is not None
    ranker.prepare()  # within a second: no new refresh
    assert ranker.current() is first
    clock.now += 5.5
    ranker.prepare()
    ranker._thread.join(10)
    assert ranker.current() is not first
