"""Serving a socketserver server without its poll: serve_forever() wakes every 0.5 s to look
for a shutdown request, two wake-ups a second for each server of an idle daemon. Here the
serving thread sleeps in select() until a connection comes or stop() writes to a pipe."""

from __future__ import annotations

import selectors
import socketserver
import threading

from oomguard.model.wakepipe import WakePipe


class QuietServing:
    """Serves `server` from a daemon thread until stop()."""

    def __init__(self, server: socketserver.TCPServer, name: str) -> None:
        self.server = server
        self.server.timeout = 0  # handle_request() is called only once select() said ready
        self._stopping = False
        self._wakeup = WakePipe()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.server.fileno(), selectors.EVENT_READ, "server")
            selector.register(self._wakeup.fileno(), selectors.EVENT_READ, "wake")
            while not self._stopping:
                for key, _events in selector.select():
                    if key.data == "server" and not self._stopping:
                        self.server.handle_request()
                self.server.service_actions()

    def stop(self, timeout: float | None = None) -> None:
        """Stop serving and wait for the thread (requests in handler threads go on)."""
        self._stopping = True
        self._wakeup.wake(b"x")
        if self.thread.is_alive():
            self.thread.join(timeout)
        self._wakeup.close()
