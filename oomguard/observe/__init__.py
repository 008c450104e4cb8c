"""What the daemon tells the world: its log (logsetup, journal, decisionlog), the metrics,
the hooks, D-Bus signals and the per-user notification agent, systemd's notify socket, and
the events that feed them (telemetry)."""
