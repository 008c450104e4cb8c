"""What the daemon tells the world: its log (logsetup, journal, decisionlog), an event's text
(rendering), the metrics, the hooks, D-Bus signals and the per-user notification agent,
systemd's notify socket, and the typed events that feed them (events)."""
