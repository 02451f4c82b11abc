"""The metrics port: an HTTP server on 127.0.0.1 that no number of connections can take the daemon down with.

The port answers every local user, so what one can do to it is bounded here
(prometheus_client's own server gives each connection a thread and an fd,
with no cap and no timeout: 4083 idle connections once took the daemon past
its fd limit). One daemonic thread accepts; at most ``MAX_CONNECTIONS``
connections are served at once, each on a daemonic thread of its own, and
one past the cap is reset as soon as it is accepted; each socket operation
times out after ``IDLE_TIMEOUT_S`` and each connection is shut down
``DEADLINE_S`` after it was accepted, whatever it sends (a slow trickle
included); the listen backlog is ``BACKLOG``. So the port never holds more
than ``MAX_CONNECTIONS + 1`` of the daemon's fds (the listening socket aside)
nor more than ``MAX_CONNECTIONS`` threads besides the accepting one. Anyone
who can open a TCP connection to 127.0.0.1 can read the metrics, per-uid
labels included (docs/configuration.md says how to restrict that).
"""

from __future__ import annotations

import http.server
import logging
import socket
import socketserver
import struct
import threading
import time
from typing import Any

log = logging.getLogger("peerd.metrics")

#: connections served at once; one past these is reset as soon as it is accepted
MAX_CONNECTIONS = 4
#: seconds any one read or write on a connection may wait
IDLE_TIMEOUT_S = 3.0
#: seconds a connection may last in all, whatever it sends
DEADLINE_S = 5.0
#: connections the kernel queues before the accepting thread takes them
BACKLOG = 8
#: how often the accepting thread wakes to shut connections past their deadline
POLL_S = 0.25
WARN_EVERY_S = 60.0  # refusals are logged at most this often
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, leaves no TIME_WAIT


class MetricsServer(http.server.HTTPServer):
    """127.0.0.1:port, at most MAX_CONNECTIONS connections at once, each for at most DEADLINE_S."""

    request_queue_size = BACKLOG
    allow_reuse_address = True  # a restarted daemon gets its port back at once
    allow_reuse_port = False

    def __init__(self, port: int, handler: type):
        """Serving at once, on a daemonic thread; ``handler``: prometheus_client's MetricsHandler, given
        the registry to expose (each of its reads and writes times out after IDLE_TIMEOUT_S)."""
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # connections being served -> when they are cut
        self.refused = 0
        self._warned_at = float("-inf")
        super().__init__(("127.0.0.1", port), type("_Timed", (handler,), {"timeout": IDLE_TIMEOUT_S}))
        self._thread = threading.Thread(target=self.serve_forever, args=(POLL_S,), name="peerd-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close the port and cut every connection still open."""
        self.shutdown()  # returns once the accepting thread has left its loop (within POLL_S)
        self.server_close()
        self.cut_all()
        self._thread.join(timeout=5)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: its getfqdn() may wait on DNS
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: a thread for the connection if a slot is free, else a reset at once."""
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning("metrics: %d connection(s) refused so far: %d already open (the most); "
                            "a local user may be flooding the port", self.refused, MAX_CONNECTIONS)
            _reset(request)
            return
        with self._lock:
            self._deadlines[request] = time.monotonic() + DEADLINE_S
        try:
            threading.Thread(target=self._serve, args=(request, client_address), name="peerd-metrics-conn",
                             daemon=True).start()
        except BaseException:  # the caller closes the connection
            with self._lock:
                self._deadlines.pop(request, None)
            self._slots.release()
            raise

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._lock:  # before the close: cut() never touches a closed (maybe reused) fd
                self._deadlines.pop(request, None)
            self.shutdown_request(request)
            self._slots.release()

    def service_actions(self) -> None:
        """On the accepting thread, every POLL_S at least: cut the connections past their deadline."""
        now = time.monotonic()
        with self._lock:
            for conn, deadline in self._deadlines.items():
                if deadline <= now:
                    _cut(conn)
                    self._deadlines[conn] = float("inf")  # cut once; its thread forgets it as it ends

    def cut_all(self) -> None:
        with self._lock:
            for conn in self._deadlines:
                _cut(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)


def _cut(conn: socket.socket) -> None:
    """Wake the connection's thread (its read or write ends at once); that thread closes it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reset(conn: socket.socket) -> None:
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    except OSError:
        pass
    conn.close()
