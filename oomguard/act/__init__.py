"""The actuators: the freezer, CRIU and how it is run, the bystanders held for a dump, the
limits lifted for a dump's headroom, the OOM shield, page-out and oomguard's swap files, the
threads' priority, the kubelet's checkpoint API. The chains that drive them are in respond/."""
