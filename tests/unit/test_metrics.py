"""oomguard.observe.metrics: sample values in the exposition, the textfile writer, the HTTP server."""

from __future__ import annotations

import os
import socket
import stat
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from oomguard.observe.metrics import Metrics, MetricsServer, TextfileWriter

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: bytes) -> Samples:
    """Every sample of an exposition, keyed by (name, sorted labels); _created samples dropped."""
    out: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: bytes) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text.decode())}


def exercised() -> Metrics:
    m = Metrics()
    m.checkpoint_done(image_bytes=300 << 20, seconds=2.0, freed_bytes=512 << 20)
    m.checkpoint_done(image_bytes=100 << 20, seconds=0.3, freed_bytes=256 << 20)
    m.checkpoint_failed()
    m.checkpoint_refused()
    m.checkpoint_refused()
    m.checkpoint_refused()
    m.restore("done", auto=True)
    m.restore("done", auto=False)
    m.restore("done", auto=False)
    m.restore("failed", auto=True)
    m.kill()
    m.detection(0.004)
    m.detection(0.2)
    m.detection(7.0)  # beyond the last finite bucket
    m.set_store(400 << 20, 2)
    m.set_guards(3, 5)
    m.set_cgroup("/jobs/a", usage=900 << 20, limit=1 << 30, pressure_some_avg10=12.5)
    m.set_cgroup("/jobs/b", usage=10 << 20, limit=None, pressure_some_avg10=None)
    m.set_cgroup("/jobs/gone", usage=1, limit=2, pressure_some_avg10=3.0)
    m.forget_cgroup("/jobs/gone")
    return m


def one(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, tuple(sorted(labels.items())))


def test_counters() -> None:
    s = samples(exercised().render())
    assert s[one("oomguard_checkpoints_total", outcome="done")] == 2
    assert s[one("oomguard_checkpoints_total", outcome="failed")] == 1
    assert s[one("oomguard_checkpoints_total", outcome="refused")] == 3
    assert s[one("oomguard_restores_total", outcome="done", auto="true")] == 1
    assert s[one("oomguard_restores_total", outcome="done", auto="false")] == 2
    assert s[one("oomguard_restores_total", outcome="failed", auto="true")] == 1
    assert s[one("oomguard_restores_total", outcome="failed", auto="false")] == 0
    assert s[one("oomguard_kills_total")] == 1
    assert s[one("oomguard_freed_bytes_total")] == 768 << 20
    assert s[one("oomguard_checkpoint_image_bytes_total")] == 400 << 20


def test_histograms() -> None:
    s = samples(exercised().render())
    assert s[one("oomguard_checkpoint_seconds_count")] == 2
    assert s[one("oomguard_checkpoint_seconds_sum")] == pytest.approx(2.3)
    ck = "oomguard_checkpoint_seconds_bucket"
    assert s[one(ck, le="0.1")] == 0
    assert s[one(ck, le="0.25")] == 0
    assert s[one(ck, le="0.5")] == 1
    assert s[one(ck, le="1.0")] == 1
    assert s[one(ck, le="2.5")] == 2
    assert s[one(ck, le="300.0")] == 2
    assert s[one(ck, le="+Inf")] == 2

    assert s[one("oomguard_detection_latency_seconds_count")] == 3
    assert s[one("oomguard_detection_latency_seconds_sum")] == pytest.approx(7.204)
    dl = "oomguard_detection_latency_seconds_bucket"
    assert s[one(dl, le="0.001")] == 0
    assert s[one(dl, le="0.0025")] == 0
    assert s[one(dl, le="0.005")] == 1
    assert s[one(dl, le="0.1")] == 1
    assert s[one(dl, le="0.25")] == 2
    assert s[one(dl, le="5.0")] == 2
    assert s[one(dl, le="+Inf")] == 3


def test_bucket_ranges() -> None:
    s = samples(Metrics().render())
    ck = sorted(float(dict(lb)["le"]) for (n, lb) in s if n == "oomguard_checkpoint_seconds_bucket")
    dl = sorted(float(dict(lb)["le"]) for (n, lb) in s if n == "oomguard_detection_latency_seconds_bucket")
    assert (ck[0], ck[-2], ck[-1]) == (0.1, 300.0, float("inf"))
    assert (dl[0], dl[-2], dl[-1]) == (0.001, 5.0, float("inf"))


def test_gauges_and_cgroups() -> None:
    s = samples(exercised().render())
    assert s[one("oomguard_store_bytes")] == 400 << 20
    assert s[one("oomguard_store_checkpoints")] == 2
    assert s[one("oomguard_guards")] == 3
    assert s[one("oomguard_cgroups_watched")] == 5
    assert s[one("oomguard_cgroup_usage_bytes", cgroup="/jobs/a")] == 900 << 20
    assert s[one("oomguard_cgroup_limit_bytes", cgroup="/jobs/a")] == 1 << 30
    assert s[one("oomguard_cgroup_pressure_some_avg10", cgroup="/jobs/a")] == 12.5
    assert s[one("oomguard_cgroup_usage_bytes", cgroup="/jobs/b")] == 10 << 20
    # No limit and no PSI: those series are absent, not 0.
    assert one("oomguard_cgroup_limit_bytes", cgroup="/jobs/b") not in s
    assert one("oomguard_cgroup_pressure_some_avg10", cgroup="/jobs/b") not in s
    # A forgotten cgroup leaves nothing behind.
    assert not [k for k in s if ("cgroup", "/jobs/gone") in k[1]]


def test_set_cgroup_none_removes_previous_values() -> None:
    m = Metrics()
    m.set_cgroup("/x", usage=5, limit=10, pressure_some_avg10=1.0)
    m.set_cgroup("/x", usage=6, limit=None, pressure_some_avg10=None)
    s = samples(m.render())
    assert s[one("oomguard_cgroup_usage_bytes", cgroup="/x")] == 6
    assert one("oomguard_cgroup_limit_bytes", cgroup="/x") not in s
    assert one("oomguard_cgroup_pressure_some_avg10", cgroup="/x") not in s


def test_forget_unknown_cgroup_is_a_no_op() -> None:
    m = Metrics()
    m.forget_cgroup("/never/seen")
    m.set_cgroup("/y", usage=1, limit=None, pressure_some_avg10=None)
    m.forget_cgroup("/y")
    m.forget_cgroup("/y")
    assert not [k for k in samples(m.render()) if k[0].startswith("oomguard_cgroup_")]


def test_fresh_instance_exports_zero_series() -> None:
    s = samples(Metrics().render())
    for outcome in ("done", "failed", "refused"):
        assert s[one("oomguard_checkpoints_total", outcome=outcome)] == 0
    for outcome in ("done", "failed"):
        for auto in ("true", "false"):
            assert s[one("oomguard_restores_total", outcome=outcome, auto=auto)] == 0
    assert s[one("oomguard_kills_total")] == 0


def test_private_registries() -> None:
    a, b = Metrics(), Metrics()  # a second instance must not collide with the first
    a.kill()
    assert samples(b.render())[one("oomguard_kills_total")] == 0
    assert a.registry is not REGISTRY
    assert REGISTRY.get_sample_value("oomguard_kills_total") is None


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.checkpoint_done(-1, 1.0, 0),
        lambda m: m.checkpoint_done(0, -1.0, 0),
        lambda m: m.checkpoint_done(0, 1.0, -1),
        lambda m: m.detection(-0.1),
        lambda m: m.restore("refused", auto=False),
    ],
)
def test_invalid_arguments_raise_and_record_nothing(call: Callable[[Metrics], None]) -> None:
    m = Metrics()
    before = samples(m.render())
    with pytest.raises(ValueError):
        call(m)
    assert samples(m.render()) == before


def test_textfile_writer(tmp_path: Path) -> None:
    m = exercised()
    writer = TextfileWriter(tmp_path)
    (tmp_path / "oomguard.prom").write_text("stale\n")
    path = writer.write(m)
    assert path == tmp_path / "oomguard.prom" == writer.path
    assert os.listdir(tmp_path) == ["oomguard.prom"]  # no temporary file left behind
    assert path.read_bytes() == m.render()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    m.kill()
    writer.write(m)
    assert samples(path.read_bytes())[one("oomguard_kills_total")] == 2
    assert os.listdir(tmp_path) == ["oomguard.prom"]


def test_textfile_writer_custom_name_and_missing_directory(tmp_path: Path) -> None:
    path = TextfileWriter(tmp_path, name="other.prom").write(Metrics())
    assert path == tmp_path / "other.prom"
    with pytest.raises(FileNotFoundError):
        TextfileWriter(tmp_path / "missing").write(Metrics())


def test_textfile_writer_cleans_up_on_failure(tmp_path: Path) -> None:
    (tmp_path / "oomguard.prom").mkdir()  # os.replace over a directory fails
    with pytest.raises(OSError):
        TextfileWriter(tmp_path).write(Metrics())
    assert os.listdir(tmp_path) == ["oomguard.prom"]


@pytest.mark.parametrize("name", ["oomguard.txt", "sub/oomguard.prom", ".prom", ".hidden.prom"])
def test_textfile_writer_rejects_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        TextfileWriter(tmp_path, name=name)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_http() -> None:
    m = exercised()
    port = free_port()
    server = m.serve(port)
    try:
        assert isinstance(server, MetricsServer)
        assert server.port == port
        assert server.server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            body = resp.read()
    finally:
        server.close()
    assert families(body) == families(m.render())
    assert samples(body) == samples(m.render())
    assert not server.serving.thread.is_alive()
    server.close()  # idempotent


def test_serve_releases_port_on_close() -> None:
    m = Metrics()
    with m.serve(0) as server:
        port = server.port
        assert port != 0
    with m.serve(port) as again:  # the socket was released, the port can be bound again
        assert again.port == port


def test_paged_out_trees_are_counted() -> None:
    from oomguard.observe.metrics import Metrics

    metrics = Metrics()
    metrics.set_paged_out(2, 300 << 20)
    text = metrics.render().decode()
    assert "oomguard_paged_out_trees 2.0" in text
    assert "oomguard_paged_out_bytes 3.145728e+08" in text
