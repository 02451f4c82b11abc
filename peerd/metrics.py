"""Prometheus metrics on 127.0.0.1 (optional: `pip install 'peerd[metrics]'`, `--metrics-port`).

Counters and latency histograms are fed by the daemon's loop as replies go
out; gauges are read from the registry at scrape time, on the HTTP thread,
through atomic copies (list() of a dict's values holds the GIL throughout),
so scraping never blocks or races the loop.

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
from typing import Any, Callable

from .outbox import Send
from .registry import Registry

log = logging.getLogger(__name__)

OUTCOME_OK = "ok"

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


class Metrics:
    def __init__(self, port: int, registry: Registry, arena_usage: Callable[[], list[dict[str, Any]]]):
        try:
            from prometheus_client import REGISTRY, Counter, Histogram
            from prometheus_client.exposition import MetricsHandler
        except ImportError:
            raise RuntimeError(
                "--metrics-port needs prometheus-client: pip install 'peerd[metrics]'"
            ) from None
        self._registry = registry
        self.requests = Counter("peerd_requests", "Requests answered, by op and outcome", ["op", "outcome"])
        self.latency = Histogram(
            "peerd_request_seconds", "Time from a request's arrival to its reply (joins include the rendezvous)",
            ["op"], buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30, 60, 120),
        )
        self.joins = Counter("peerd_joins", "Joins answered, by outcome (ok or the error code)", ["outcome"])
        self.agreements = Counter("peerd_agreements", "tp_agree rounds answered by the daemon (the message path; "
                                  "rounds on a control page never reach it), by outcome", ["outcome"])
        REGISTRY.register(_Gauges(registry, arena_usage))
        handler = type("_Handler", (MetricsHandler,), {"registry": REGISTRY, "timeout": IDLE_TIMEOUT_S})
        self.server = _Server(port, handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(POLL_S,), name="peerd-metrics",
                                       daemon=True)
        self.thread.start()

    def answered(self, send: Send) -> None:
        """Count and time one reply; its route (peerd.server.Route) says which op and since when."""
        op, started = send.caller.op, send.caller.since
        if op is None:  # refused before its op was read
            return
        if send.error is not None:
            outcome = send.error.code.value
        elif op in ("agree", "commit"):
            outcome = str(bool(send.body.get("ok"))).lower()
        else:
            outcome = OUTCOME_OK
        self.requests.labels(op, outcome).inc()
        self.latency.labels(op).observe(time.monotonic() - started)
        if op == "join":
            self.joins.labels(outcome).inc()
        elif op == "agree":
            self.agreements.labels(outcome).inc()

    def close(self) -> None:
        """Stop accepting, close the port and cut every connection still open."""
        self.server.shutdown()  # returns once the accepting thread has left its loop (within POLL_S)
        self.server.server_close()
        self.server.cut_all()
        self.thread.join(timeout=5)


class _Server(http.server.HTTPServer):
    """127.0.0.1:port, at most MAX_CONNECTIONS connections at once, each for at most DEADLINE_S."""

    request_queue_size = BACKLOG
    allow_reuse_address = True  # a restarted daemon gets its port back at once
    allow_reuse_port = False

    def __init__(self, port: int, handler: type):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # connections being served -> when they are cut
        self.refused = 0
        self._warned_at = float("-inf")
        super().__init__(("127.0.0.1", port), handler)

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


class _Gauges:
    """Buffer sets by state, ranks held, bytes by device, arena chunks, rank deaths: read at scrape time."""

    def __init__(self, registry: Registry, arena_usage: Callable[[], list[dict[str, Any]]]):
        self._registry = registry
        self._arena_usage = arena_usage  # takes the arenas' lock: a scrape waits for at most one allocation

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sets = self._registry.all_sets()  # list() copies of dict values: atomic under the GIL
        by_state = GaugeMetricFamily("peerd_buffer_sets", "Buffer sets, by state", labels=["state"])
        counts: dict[str, int] = {}
        held = 0
        for b in sets:
            counts[b.state.value] = counts.get(b.state.value, 0) + 1
            held += sum(1 for s in list(b.slots.values()) if s.held)
        for state, n in sorted(counts.items()):
            by_state.add_metric([state], n)
        yield by_state
        yield GaugeMetricFamily("peerd_ranks_held", "Ranks holding a buffer set", value=held)
        by_device = GaugeMetricFamily("peerd_bytes_allocated", "Bytes allocated, by device", labels=["device"])
        for device, n in sorted(dict(self._registry.bytes_by_device).items()):
            by_device.add_metric([device], n)
        yield by_device
        reserved = GaugeMetricFamily("peerd_arena_reserved_bytes", "Bytes of arena chunks reserved, by device and uid",
                                     labels=["device", "uid"])
        handed_out = GaugeMetricFamily("peerd_arena_handed_out_bytes",
                                       "Bytes of arena chunks handed out as buffers, by device and uid",
                                       labels=["device", "uid"])
        for row in self._arena_usage():
            labels = [row["device"], str(row["uid"])]
            reserved.add_metric(labels, row["reserved_bytes"])
            handed_out.add_metric(labels, row["handed_out_bytes"])
        yield reserved
        yield handed_out
        yield CounterMetricFamily("peerd_rank_deaths", "Client processes that died holding a rank",
                                  value=self._registry.rank_deaths)
