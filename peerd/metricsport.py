"""The metrics port: an HTTP server on 127.0.0.1 that no number of connections can take the daemon down with.

The port answers every local user, so what one can do to it is bounded here
(prometheus_client's own server gives each connection a thread and an fd,
with no cap and no timeout: 4083 idle connections once took the daemon past
its fd limit). One daemonic thread accepts; at most ``MAX_CONNECTIONS``
connections are served at once, and at most ``MAX_CONNECTIONS_PER_UID`` of
one uid (the kernel's word for the connecting socket's owner, asked through
sock_diag), each on a daemonic thread of its own, and one past either cap
is reset as soon as it is accepted: a user holding connections open keeps
only its own share, and the scraper still gets in; each socket operation
times out after ``IDLE_TIMEOUT_S`` and each connection is shut down
``DEADLINE_S`` after it was accepted, whatever it sends (a slow trickle
included); the listen backlog is ``BACKLOG``. So the port never holds more
than ``MAX_CONNECTIONS + 2`` of the daemon's fds (the listening socket aside;
the two: a connection being accepted and its sock_diag query)
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

from .index import tally

log = logging.getLogger("peerd.metrics")

#: connections served at once; one past these is reset as soon as it is accepted
MAX_CONNECTIONS = 8
#: connections of one uid served at once (those whose uid the kernel cannot tell share one such share)
MAX_CONNECTIONS_PER_UID = 3
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
        self._by_uid: dict[int | None, int] = {}  # connections being served, by their owner's uid
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
        """On the accepting thread: a thread for the connection if its uid's share and a slot are free,
        else a reset at once."""
        uid = peer_uid(self.server_address, client_address)
        with self._lock:
            mine = self._by_uid.get(uid, 0)
            taken = mine < MAX_CONNECTIONS_PER_UID and self._slots.acquire(blocking=False)
            if taken:
                tally(self._by_uid, uid, 1)
                self._deadlines[request] = time.monotonic() + DEADLINE_S
        if not taken:
            self._refuse(request, uid)
            return
        try:
            threading.Thread(target=self._serve, args=(request, client_address, uid), name="peerd-metrics-conn",
                             daemon=True).start()
        except BaseException:  # the caller closes the connection
            self._forget(request, uid)
            raise

    def _refuse(self, request: Any, uid: int | None) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("metrics: %d connection(s) refused so far (the last of uid %s): at most %d are served "
                        "at once, %d per uid; a local user may be flooding the port", self.refused, uid,
                        MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID)
        _reset(request)

    def _serve(self, request: Any, client_address: Any, uid: int | None) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._forget(request, uid)  # before the close: cut() never touches a closed (maybe reused) fd
            self.shutdown_request(request)

    def _forget(self, request: Any, uid: int | None) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
            tally(self._by_uid, uid, -1)
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


def peer_uid(server: tuple[str, int], client: tuple[str, int]) -> int | None:
    """The uid owning the socket at ``client`` connected to ``server`` (both 127.0.0.1), as the kernel
    reports it (sock_diag, what ``ss -e`` shows); None where it cannot say (the socket is gone already)."""
    try:
        sockid = (struct.pack("!HH", client[1], server[1]) + socket.inet_aton(client[0]) + bytes(12)
                  + socket.inet_aton(server[0]) + bytes(12) + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF))
        request = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
        header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as diag:
            diag.settimeout(1.0)
            diag.send(header + request)
            reply = diag.recv(4096)
    except OSError:
        return None
    if len(reply) < _DIAG_UID_AT + 4 or struct.unpack_from("=H", reply, 4)[0] != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket
    if reply[16 + 1] == _TCP_TIME_WAIT:  # closed already: the kernel reports such a socket as root's
        return None
    return struct.unpack_from("=I", reply, _DIAG_UID_AT)[0]


_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST = 4, 20, 1
_TCP_TIME_WAIT = 6
#: where inet_diag_msg's idiag_uid sits in a reply: the netlink header, 4 bytes, the 48-byte sockid, 3 words
_DIAG_UID_AT = 16 + 4 + 48 + 12


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
