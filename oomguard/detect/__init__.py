"""Detections: what makes a rule act, one plug-in module each, as an oomd detector is one
file. A system rule's (MemAvailable at a floor, memory pressure), a cgroup rule's beside its
threshold (time-to-limit) and any rule's on the GPUs' memory (a device at a share used). A
plug-in declares its own config keys (with their kinds and defaults), judges the readings it
needs, keeps its own state where it needs one, and says in words what it watches; the config
loader, the examiner, the arming, the GPU watch and the startup line take every plug-in from
the registry (oomguard.detect.registry). Adding one is one module here and one line there."""
