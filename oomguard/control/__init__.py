"""The control socket: a small JSON protocol framed the way varlink frames it (see protocol.py)."""
