"""The actuators: a rule's action steps (steps: the grammar; chain: running them; acting:
the victim and the chain together), the freezer, CRIU and its action script, the limits
lifted for a dump's headroom, the kubelet's checkpoint API, the command runner."""
