"""`oomguard run`: wire the real parts together and run the guard loop and the control socket."""

from __future__ import annotations

import contextlib
import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard import __version__
from oomguard.config.loading import DaemonConfig, SlurmConfig
from oomguard.control.prekill import SOCKET_NAME, dispatch_prekill
from oomguard.control.realparts import (
    build_checkpointer,
    build_containers,
    build_criu,
    build_gpu,
    build_podman,
    build_restorer,
    build_service,
    remove_criu_cgroup,
)
from oomguard.control.server import ControlServer
from oomguard.daemon.guardlines import gpu_summary
from oomguard.daemon.guards import daemon_lookup
from oomguard.daemon.locks import cgroup_keys
from oomguard.daemon.loop import Daemon
from oomguard.daemon.standby import Standby
from oomguard.daemon.telemetry import EventTap, publish_gauges
from oomguard.lifecycle.exitwatch import ExitWatch, record_exit, rewatch_restored
from oomguard.model.errors import StoreError
from oomguard.observe.dbus import SignalEmitter
from oomguard.observe.history import EventHistory
from oomguard.observe.hooks import HookRun, HookRunner
from oomguard.observe.logsetup import RecordingLogger
from oomguard.observe.sdnotify import Notifier
from oomguard.observe.slurm import SlurmNotifier, find_scontrol
from oomguard.sense.cnproc import FORKS, ProcessExit
from oomguard.sense.procevents import Subscriber, process_events_words
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import Store
from oomguard.terminal.leases import job_ended

if TYPE_CHECKING:  # prometheus_client (~4 MiB) is imported only where metrics are wanted
    from oomguard.act.criu import Criu
    from oomguard.cgroup.mounts import CgroupLayout
    from oomguard.control.service import Service
    from oomguard.daemon.locks import DaemonLocks
    from oomguard.gpu.runtime import GpuSupport
    from oomguard.lifecycle.checkpoint import Checkpointer
    from oomguard.lifecycle.restore import Restorer
    from oomguard.observe.metrics import Metrics, TextfileWriter


class Heartbeat:
    """After every loop turn: the watchdog ping, and every EVERY seconds the STATUS= line
    (under systemd) and the node_exporter textfile (when configured). Where neither is wanted
    it asks the loop for no wake-up at all; a metrics port reads the gauges when scraped."""

    EVERY = 2.0

    def __init__(self, daemon: Daemon, notifier: Notifier, metrics: Metrics | None,
                 textfile: TextfileWriter | None, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.daemon = daemon
        self.notifier = notifier
        self.metrics = metrics
        self.textfile = textfile
        self.clock = clock
        self._next = 0.0

    def due_in(self, now: float) -> float | None:
        """Seconds until the next beat is wanted; None: only when the loop turns anyway."""
        if self.textfile is None and not self.notifier.enabled:
            return None
        return max(0.0, self._next - now)

    def __call__(self) -> None:
        self.notifier.watchdog()
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.EVERY
        if self.notifier.enabled:
            self.notifier.status(self.daemon.summary())
        if self.textfile is not None and self.metrics is not None:
            with contextlib.suppress(OSError):
                self.textfile.write(self.metrics)  # the gauges are read as it renders


def gauge_reader(metrics: Metrics, daemon: Daemon) -> Callable[[], None]:
    """What the metrics read when they are rendered (a scrape, a textfile write): the guards'
    usage and limits now, and the store; nothing is read on a timer."""
    def refresh() -> None:
        publish_gauges(metrics, list(daemon.guards), daemon.upkeep.listed())
        trees = daemon.auto_resume.tools.record.trees()
        metrics.set_paged_out(len(trees), sum(t.paged_bytes for t in trees))
    return refresh


def build_slurm(settings: SlurmConfig) -> SlurmNotifier | None:
    """Tell Slurm about checkpointed job steps: on where scontrol is installed ("auto")."""
    if settings.notify == "off":
        return None
    binary = find_scontrol(settings.scontrol)
    if binary is None:
        return None if settings.notify == "auto" else SlurmNotifier(settings.scontrol,
                                                                  settings.after_checkpoint,
                                                                  settings.grow_memory)
    return SlurmNotifier(binary, settings.after_checkpoint, settings.grow_memory)


def raise_open_files_limit() -> int:
    """Each guarded v1 cgroup holds up to six eventfds (usage marks, the OOM notification, the
    reclaim count): a thousand cgroups need more than the soft limit systemd gives services
    (1024). Raise it
    to the hard limit; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


def _exit_recorder(store: Store, log: Any, why_unknown: Callable[[], str | None],
                   ) -> Callable[[str, int, float, ProcessExit | None], None]:
    """A restored tree's root exited: into its meta.json, and the `restore.exited` event."""

    def exited(checkpoint_id: str, pid: int, exited_at: float,
               status: ProcessExit | None) -> None:
        fields = record_exit(store, checkpoint_id, pid, exited_at, status)
        with contextlib.suppress(StoreError):
            meta = store.get(checkpoint_id)
            if meta.restored_pid == pid:
                job_ended(meta.extra, meta.uid, status.exit_code if status else None,
                          status.signal if status else None)
        if status is None:
            fields["explanation"] = why_unknown() or (
                "the kernel's exit event was not seen (it ended before it was watched, or "
                "events were lost)")
        log.warning("restore.exited", id=checkpoint_id, pid=pid, **fields)
    return exited


def wanted_metrics(config: DaemonConfig) -> Metrics | None:
    """The daemon's metrics where they go somewhere (a port or a textfile directory); else
    none are kept, and prometheus_client is not imported."""
    if not (config.metrics_port or config.metrics_textfile_dir):
        return None
    from oomguard.observe.metrics import Metrics

    return Metrics()


def hook_logger(log: Any) -> Callable[[HookRun], None]:
    """Each hook run, as it ends: `hook.done`, or `hook.failed` with what it wrote."""
    def done(run: HookRun) -> None:
        if run.result == 0:
            log.info("hook.done", hook=run.event, seconds=round(run.seconds, 3))
        else:
            log.warning("hook.failed", hook=run.event, result=run.result,
                        seconds=round(run.seconds, 3), output=run.detail or None,
                        explanation="the command in [hooks] did not succeed (run by /bin/sh "
                        "-c; the event's fields are in its environment)")
    return done


def apply_hooks(tap: EventTap, config: DaemonConfig) -> None:
    """A reload's hooks take effect at once: added, changed or removed."""
    if tap.hooks is None:
        if config.hooks and tap.log is not None:
            tap.hooks = HookRunner(dict(config.hooks), timeout=config.hook_timeout,
                                   on_done=hook_logger(tap.log))
        return
    tap.hooks.commands = {event: cmd for event, cmd in config.hooks if cmd.strip()}
    tap.hooks.timeout = config.hook_timeout


def settle_heap() -> None:
    """Once the guards are built: what exists now (a thousand guards' objects and their
    snapshots) is moved out of the cyclic collector's sight (gc.freeze), so that its full
    passes, which can land on a crossing, stop walking it: with 1000 guarded cgroups such a
    pass took 16 ms, in the middle of the path from the kernel's event to the SIGSTOP."""
    gc.collect()
    gc.freeze()


def run_daemon(config: DaemonConfig, base_log: Any, layout: CgroupLayout,
               locks: DaemonLocks) -> int:
    """The daemon, once `locks` (oomguard.daemon.locks.held_for) are held: the store's and
    the guarded cgroups'."""
    began = time.monotonic()
    open_files = raise_open_files_limit()
    metrics = wanted_metrics(config)
    emitter = SignalEmitter(config.dbus_address) if config.dbus_notify else None
    tap, log = _event_outlets(config, base_log, metrics, emitter)
    notifier = Notifier.from_env()
    proc = ProcReader()
    gpu = build_gpu(config.gpu)
    criu = build_criu(config.criu, layout, proc, gpu, config.store)
    # The freeze's process events: tried once now (which also loads pyroute2 now rather
    # than at the first crossing), said in guard.started.
    subscriptions = Subscriber(kinds=FORKS)
    no_events = subscriptions.probe()
    checkpointer = build_checkpointer(config, criu, proc, events=subscriptions)
    restorer = build_restorer(config, criu, proc, events=subscriptions, layout=layout)
    restorer.exits = exit_watch = ExitWatch(_exit_recorder(
        restorer.store, log, lambda: exit_watch.why_unknown()))
    daemon = Daemon(config, checkpointer, layout, log, proc=proc, restorer=restorer,
                    containers=build_containers(config.kubernetes),
                    podman=build_podman(config.podman), after_arming=settle_heap,
                    events=log, standby=None if config.dry_run else Standby(
                        config.node_state_dir, log, proc))
    daemon.rules.claim = lambda new: locks.take_cgroups(cgroup_keys(new, layout))
    daemon.rules.on_reload = lambda new: apply_hooks(tap, new)
    daemon.install_signal_handlers()
    outlets = _Outlets()
    if metrics is not None:
        _serve_metrics(metrics, config, log, daemon, outlets)
    beat = Heartbeat(daemon, notifier, metrics, outlets.textfile)
    daemon.heartbeat, daemon.heartbeat_due = beat, beat.due_in
    daemon.max_sleep = notifier.watchdog_interval()
    service = _start_control(config, layout, proc, checkpointer, restorer, daemon, log, outlets)
    if config.oomd_prekill_dir is not None and service is not None:
        _start_prekill(config.oomd_prekill_dir, service, log, outlets)
    daemon.priority.raise_()  # this thread is the event loop's
    _log_started(config, layout, log, daemon, criu, gpu, open_files, no_events,
                 answering=outlets.server is not None)
    try:
        daemon.arm()
        _rewatch(restorer.store, exit_watch, log)
        _ready(daemon, notifier, log, began)
        beat()
        daemon.run()
    finally:
        notifier.stopping()
        outlets.stop_listening()
        daemon.close()
        exit_watch.close()
        outlets.close()
        if tap.hooks is not None:
            tap.hooks.join(daemon.config.hook_timeout)
        if emitter is not None:
            emitter.close()
        remove_criu_cgroup(layout, proc)
        log.info("guard.stopped")
    return 0


def _event_outlets(config: DaemonConfig, base_log: Any, metrics: Metrics | None,
                   emitter: SignalEmitter | None) -> tuple[EventTap, RecordingLogger]:
    """Where the daemon's events go: the log (also the daemon's EventSink; its events of
    note are kept in the store for `status`), the metrics, D-Bus, Slurm and the hooks."""
    tap = EventTap(metrics, None, emitter, slurm=build_slurm(config.slurm))
    log = RecordingLogger(base_log, tap=tap.tell, history=EventHistory(config.node_state_dir))
    tap.log = log
    apply_hooks(tap, config)
    return tap, log


def _rewatch(store: Store, exit_watch: ExitWatch, log: Any) -> None:
    rewatched = rewatch_restored(store, exit_watch)
    if rewatched:
        log.info("restore.watching", ids=rewatched,
                 explanation="restored by an earlier run and still running: their exit "
                 "is recorded")


def _ready(daemon: Daemon, notifier: Notifier, log: Any, began: float) -> None:
    """READY=1 only now: every guard is armed and the socket answers."""
    notifier.ready(daemon.summary())
    log.info("guard.ready", seconds=round(time.monotonic() - began, 3),
             guards=daemon.armed_count(), summary=daemon.summary())


@dataclass
class _Outlets:
    """What the daemon serves besides its loop, each closed at its stop."""

    server: ControlServer | None = None  # the control socket
    prekill: ControlServer | None = None  # systemd-oomd's prekill hook
    metrics_server: Any = None  # the metrics port's server
    textfile: TextfileWriter | None = None  # node_exporter's textfile

    def stop_listening(self) -> None:
        """No new calls (before the daemon closes: what it answers needs the daemon)."""
        for listener in (self.server, self.prekill):
            if listener is not None:
                listener.stop()

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()


def _serve_metrics(metrics: Metrics, config: DaemonConfig, log: Any, daemon: Daemon,
                   outlets: _Outlets) -> None:
    from oomguard.observe.metrics import TextfileWriter

    if config.metrics_textfile_dir:
        outlets.textfile = TextfileWriter(config.metrics_textfile_dir)
    if config.metrics_port:
        try:
            outlets.metrics_server = server = metrics.serve(config.metrics_port,
                                                            config.metrics_address)
            log.info("metrics.listening", address=f"{config.metrics_address}:{server.port}",
                     url=f"http://{config.metrics_address}:{server.port}/metrics")
        except OSError as exc:
            log.warning("metrics.unavailable", port=config.metrics_port, error=str(exc))
    metrics.before_render = gauge_reader(metrics, daemon)


def _start_control(config: DaemonConfig, layout: CgroupLayout, proc: ProcReader,
                   checkpointer: Checkpointer, restorer: Restorer, daemon: Daemon, log: Any,
                   outlets: _Outlets) -> Service | None:
    """The control socket (the CLI falls back to direct access, root only, without it).
    Returns the service it answers with (None: it could not be built)."""
    service = None
    try:
        service = build_service(config, layout, proc, checkpointer=checkpointer,
                                restorer=restorer, status=daemon.status,
                                user_headroom=daemon.cgroup_guards.user_headroom)
        service.events = log
        service.on_event = log.warning
        service.guard_of = daemon_lookup(lambda: daemon.guards)
        service.prefs_of = daemon.cgroup_guards.preferences_for
        service.after_checkpoint = daemon.settle_soon
        outlets.server = ControlServer(config.socket, service, note=log.info, debug=log.debug,
                                       idle_timeout=config.control_idle_timeout,
                                       call_rate=config.control_call_rate)
        outlets.server.start()
    except OSError as exc:
        outlets.server = None
        log.warning("control.unavailable", socket=str(config.socket), error=str(exc),
                    explanation="the CLI falls back to direct access (root only)")
    return service


def _start_prekill(directory: Path, service: Service, log: Any,
                   outlets: _Outlets) -> None:
    try:
        outlets.prekill = ControlServer(directory / SOCKET_NAME, service, note=log.info,
                                        dispatcher=dispatch_prekill, mode=0o660)
        outlets.prekill.start()
        log.info("oomd.prekill_registered", socket=str(outlets.prekill.path),
                 explanation="systemd-oomd asks oomguard to checkpoint a cgroup before it "
                 "kills it")
    except OSError as exc:
        outlets.prekill = None
        log.warning("oomd.prekill_unavailable", dir=str(directory), error=str(exc))


def _log_started(config: DaemonConfig, layout: CgroupLayout, log: Any, daemon: Daemon,
                 criu: Criu, gpu: GpuSupport, open_files: int, no_events: str | None,
                 answering: bool) -> None:
    """guard.started, and what the guard runs without (its priority, any rule)."""
    gpu_words, gpu_detail = gpu_summary(gpu)  # no probe text where there is no driver
    log.info("guard.started", version=__version__, config=config.source, store=str(config.store),
             socket=str(config.socket) if answering else None, criu=criu.binary,
             criu_version=".".join(map(str, criu.version)), cgroup_mode=layout.mode,
             guards=len(config.guards), dry_run=config.dry_run, open_files_limit=open_files,
             gpu=gpu_words, **({"gpu_detail": gpu_detail} if gpu_detail else {}),
             process_events=process_events_words(no_events),
             nice=daemon.priority.nice if daemon.priority.enabled else 0,
             **({"node_state": str(config.node_state_dir)}
                if config.node_state_dir != config.store else {}))
    if daemon.priority.error is not None:
        log.warning("guard.priority_unavailable", error=daemon.priority.error,
                    explanation="the guard runs at the ordinary priority: on busy CPUs a "
                    "crossing waits its turn (needs CAP_SYS_NICE or RLIMIT_NICE; set "
                    "daemon.nice = 0 to say so)")
    if not config.guards:
        log.warning("guard.idle", explanation="no [[guard]] rules: nothing is watched; add one "
                    "to the config or pass --cgroup")
