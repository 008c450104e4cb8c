"""Prometheus metrics: counters, histograms and gauges on a private registry.

``Metrics`` owns its own ``CollectorRegistry`` (never the process-global default one), so two
instances never collide and tests need no cleanup. It is exposed either as a textfile for
node_exporter's textfile collector (``TextfileWriter``) or over HTTP (``Metrics.serve``).

prometheus_client's metric objects are thread-safe; the per-cgroup label sets are additionally
updated under one lock so that ``set_cgroup`` and ``forget_cgroup`` never interleave.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from oomguard.model.atomicfile import write_atomically
from oomguard.model.quietserve import QuietServing

OUTCOME_DONE = "done"
OUTCOME_FAILED = "failed"
OUTCOME_REFUSED = "refused"
CHECKPOINT_OUTCOMES = (OUTCOME_DONE, OUTCOME_FAILED, OUTCOME_REFUSED)
RESTORE_OUTCOMES = (OUTCOME_DONE, OUTCOME_FAILED)

# A checkpoint takes from a fraction of a second (small process) to minutes (tens of GiB).
CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0)
# From the pressure signal (PSI trigger, usage sample) to the decision to act.
DETECTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

DEFAULT_TEXTFILE_NAME = "oomguard.prom"
TEXTFILE_MODE = 0o644
DEFAULT_ADDRESS = "127.0.0.1"
SERVER_JOIN_TIMEOUT = 5.0

StartServer = Callable[..., tuple[WSGIServer, QuietServing]]


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def start_http_server(port: int, addr: str = DEFAULT_ADDRESS,
                      registry: CollectorRegistry | None = None) -> tuple[WSGIServer, QuietServing]:
    """prometheus_client's start_http_server (its WSGI app, its threading server, its quiet
    request handler), served without serve_forever's twice-a-second wake-up."""

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    httpd = make_server(addr, port, make_wsgi_app(registry or REGISTRY), Server,
                        handler_class=_QuietHandler)
    serving = QuietServing(httpd, "oomguard-metrics")
    serving.start()
    return httpd, serving


def _non_negative(what: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")


class _BeforeRender(Collector):
    """Registered first, so collected first: calls Metrics.before_render, which sets the
    gauges from what is true now (read when scraped, never on a timer). Yields nothing."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # no names of its own (and registering does not collect)

    def collect(self) -> list[Metric]:
        hook = self.metrics.before_render
        if hook is not None:
            hook()
        return []


class Metrics:
    """All of oomguard's metrics, on a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._cgroup_lock = threading.Lock()
        # Called before every rendering (a scrape, a textfile write) to set the gauges.
        self.before_render: Callable[[], None] | None = None
        r = self.registry
        r.register(_BeforeRender(self))

        self._register_event_metrics(r)
        self._register_gauges(r)

        # Export every known label combination from the start, at 0, so that rate() and
        # absent() behave before the first event.
        for outcome in CHECKPOINT_OUTCOMES:
            self._checkpoints.labels(outcome=outcome)
        for outcome in RESTORE_OUTCOMES:
            for auto in (True, False):
                self._restores.labels(outcome=outcome, auto=_bool_label(auto))

    def _register_event_metrics(self, r: CollectorRegistry) -> None:
        """What happened: counters and histograms, by the events that count them."""
        self._checkpoints = Counter(
            "oomguard_checkpoints_total",
            "Checkpoint attempts, by outcome (done, failed, refused by policy/preflight).",
            ["outcome"],
            registry=r,
        )
        self._restores = Counter(
            "oomguard_restores_total",
            "Restores, by outcome (done, failed) and whether oomguard started them itself.",
            ["outcome", "auto"],
            registry=r,
        )
        self._kills = Counter("oomguard_kills_total", "Processes killed by oomguard.", registry=r)
        self._freed = Counter(
            "oomguard_freed_bytes_total",
            "Memory freed in guarded cgroups by successful checkpoints, in bytes.",
            registry=r,
        )
        self._image_bytes = Counter(
            "oomguard_checkpoint_image_bytes_total",
            "Size of the images written by successful checkpoints, in bytes.",
            registry=r,
        )
        self._checkpoint_seconds = Histogram(
            "oomguard_checkpoint_seconds",
            "Duration of successful checkpoints, in seconds.",
            buckets=CHECKPOINT_BUCKETS,
            registry=r,
        )
        self._detection_seconds = Histogram(
            "oomguard_detection_latency_seconds",
            "Latency from the memory-pressure signal to oomguard's decision to act, in seconds.",
            buckets=DETECTION_BUCKETS,
            registry=r,
        )

    def _register_gauges(self, r: CollectorRegistry) -> None:
        """What is true now: set before every rendering (before_render)."""
        self._store_bytes = Gauge("oomguard_store_bytes", "Bytes used by the checkpoint store.", registry=r)
        self._store_checkpoints = Gauge(
            "oomguard_store_checkpoints", "Checkpoints held in the store.", registry=r
        )
        self._paged_out = Gauge(
            "oomguard_paged_out_trees", "Process trees paged out and kept stopped until they "
            "fit (the pageout action).", registry=r)
        self._paged_out_bytes = Gauge(
            "oomguard_paged_out_bytes", "Bytes those trees have in swap.", registry=r)
        self._guards = Gauge("oomguard_guards", "Configured guards.", registry=r)
        self._cgroups_watched = Gauge(
            "oomguard_cgroups_watched", "Memory cgroups currently watched.", registry=r
        )
        self._cgroup_usage = Gauge(
            "oomguard_cgroup_usage_bytes",
            "Memory usage of a guarded cgroup, in bytes.",
            ["cgroup"],
            registry=r,
        )
        self._cgroup_limit = Gauge(
            "oomguard_cgroup_limit_bytes",
            "Memory limit of a guarded cgroup, in bytes (absent when unlimited).",
            ["cgroup"],
            registry=r,
        )
        self._cgroup_pressure = Gauge(
            "oomguard_cgroup_pressure_some_avg10",
            "Memory pressure of a guarded cgroup: PSI 'some' avg10, in percent (absent without PSI).",
            ["cgroup"],
            registry=r,
        )

    # -- events ---------------------------------------------------------------------------------

    def checkpoint_done(self, image_bytes: int, seconds: float, freed_bytes: int) -> None:
        """A checkpoint succeeded. Raises ValueError on a negative argument (nothing recorded)."""
        _non_negative("image_bytes", image_bytes)
        _non_negative("seconds", seconds)
        _non_negative("freed_bytes", freed_bytes)
        self._checkpoints.labels(outcome=OUTCOME_DONE).inc()
        self._image_bytes.inc(image_bytes)
        self._checkpoint_seconds.observe(seconds)
        self._freed.inc(freed_bytes)

    def checkpoint_failed(self) -> None:
        self._checkpoints.labels(outcome=OUTCOME_FAILED).inc()

    def checkpoint_refused(self) -> None:
        self._checkpoints.labels(outcome=OUTCOME_REFUSED).inc()

    def restore(self, outcome: str, auto: bool) -> None:
        """A restore ended; ``outcome`` is "done" or "failed" (else ValueError)."""
        if outcome not in RESTORE_OUTCOMES:
            raise ValueError(f"restore outcome must be one of {RESTORE_OUTCOMES}, got {outcome!r}")
        self._restores.labels(outcome=outcome, auto=_bool_label(auto)).inc()

    def kill(self) -> None:
        self._kills.inc()

    def detection(self, seconds: float) -> None:
        _non_negative("seconds", seconds)
        self._detection_seconds.observe(seconds)

    # -- state ----------------------------------------------------------------------------------

    def set_store(self, bytes_: int, count: int) -> None:
        self._store_bytes.set(bytes_)
        self._store_checkpoints.set(count)

    def set_paged_out(self, trees: int, bytes_: int) -> None:
        self._paged_out.set(trees)
        self._paged_out_bytes.set(bytes_)

    def set_guards(self, guards: int, cgroups: int) -> None:
        self._guards.set(guards)
        self._cgroups_watched.set(cgroups)

    def set_cgroup(self, name: str, usage: int, limit: int | None, pressure_some_avg10: float | None) -> None:
        """Set a guarded cgroup's gauges; a ``None`` limit/pressure removes that series."""
        with self._cgroup_lock:
            self._cgroup_usage.labels(cgroup=name).set(usage)
            if limit is None:
                _remove(self._cgroup_limit, name)
            else:
                self._cgroup_limit.labels(cgroup=name).set(limit)
            if pressure_some_avg10 is None:
                _remove(self._cgroup_pressure, name)
            else:
                self._cgroup_pressure.labels(cgroup=name).set(pressure_some_avg10)

    def forget_cgroup(self, name: str) -> None:
        """Drop every series of a cgroup that went away; unknown names are ignored."""
        with self._cgroup_lock:
            for gauge in (self._cgroup_usage, self._cgroup_limit, self._cgroup_pressure):
                _remove(gauge, name)

    # -- exposition -----------------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)

    def serve(
        self,
        port: int,
        address: str = DEFAULT_ADDRESS,
        *,
        start: StartServer = start_http_server,
    ) -> MetricsServer:
        """Serve ``/metrics`` over HTTP from a daemon thread; localhost only by default.

        ``port`` 0 binds an ephemeral port (see ``MetricsServer.port``). Raises OSError when the
        address cannot be bound. Shut it down with ``close()`` (or use it as a context manager).
        """
        server, serving = start(port, addr=address, registry=self.registry)
        return MetricsServer(server=server, serving=serving)


@dataclass
class MetricsServer:
    """A running metrics HTTP server and what serves it."""

    server: WSGIServer
    serving: QuietServing
    _closed: bool = field(default=False, init=False)

    @property
    def port(self) -> int:
        """The port actually bound (useful after ``serve(0)``)."""
        return int(self.server.server_address[1])

    def close(self, timeout: float = SERVER_JOIN_TIMEOUT) -> None:
        """Stop serving, release the socket and join the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.serving.stop(timeout)
        self.server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class TextfileWriter:
    """Writes a ``Metrics`` rendering for node_exporter's textfile collector.

    Each write goes to a hidden temporary file in the same directory (its name does not end in
    ``.prom``, so the collector never reads it), is made mode 0644 and renamed over the target:
    a reader sees the previous file or the new one, never a partial one. There is deliberately
    no fsync: the file is regenerated periodically, and an fsync can stall for a long time on a
    machine under memory pressure, which is exactly when oomguard must stay responsive.
    """

    def __init__(self, directory: Path, name: str = DEFAULT_TEXTFILE_NAME) -> None:
        if not name.endswith(".prom") or name.startswith(".") or "/" in name or name == ".prom":
            raise ValueError(f"textfile name must be a plain file name ending in .prom, got {name!r}")
        self.directory = directory
        self.name = name

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def write(self, metrics: Metrics) -> Path:
        """Render ``metrics`` and replace the textfile atomically; returns its path.

        Raises OSError (e.g. the directory is missing); no temporary file is left behind.
        """
        data = metrics.render()
        write_atomically(self.path, data, TEXTFILE_MODE, sync=False)
        return self.path


def _bool_label(value: bool) -> str:
    return "true" if value else "false"


def _remove(gauge: Gauge, name: str) -> None:
    # Older prometheus-client releases raise KeyError for an unknown label set; recent ones ignore it.
    with contextlib.suppress(KeyError):
        gauge.remove(name)
