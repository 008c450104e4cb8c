"""Detections: what makes a system rule act, one plug-in module each (MemAvailable at a floor,
memory pressure), as an oomd detector is one file. A plug-in declares its own config keys (with
their kinds and defaults), judges the readings it needs, and says in words what it watches; the
config loader, the examiner and the startup line take every plug-in from the registry
(oomguard.detect.registry). Adding one is one module here and one line there."""
