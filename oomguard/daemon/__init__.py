"""The daemon: the guard loop (loop.py) and what it keeps (guards, arming, examining, settling,
the store's upkeep, the GPU and park watches), what it says at start-up and in `status`, the
tap that hands its events on (telemetry), and serve.py, which runs it all (the real parts are
put together in control/realparts.py)."""
