"""The daemon: the guard loop (loop.py) and what it keeps (guards, arming, examining, settling,
the store's upkeep, the GPU and park watches, exit watching), what it says at start-up and in
`status`, and the composition root that puts the real parts together (realparts.py, serve.py)."""
