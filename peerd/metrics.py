"""Prometheus metrics on 127.0.0.1 (optional: prometheus-client, the `metrics` extra; `--metrics-port`).

Counters and latency histograms are fed by the daemon's loop as replies go
out; gauges are read from the registry at scrape time, on the HTTP thread,
through atomic copies (list() of a dict's values holds the GIL throughout),
so scraping never blocks or races the loop.

The HTTP server is peerd.metricsport's: bounded, because every local user can reach it.
Every local user can also take the port first, so a port in use never stops the daemon:
it serves without metrics, says so, and tries the port again every BIND_RETRY_S.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .buffersets import State
from .metricsport import MetricsServer
from .outbox import Send
from .registry import Registry

OUTCOME_OK = "ok"
#: seconds between tries of a metrics port another process holds
BIND_RETRY_S = 5.0

log = logging.getLogger("peerd.metrics")


def require_prometheus() -> None:
    """Refuse to start without prometheus-client where metrics are asked for: checked with the other
    start-up checks, before the socket is claimed or a GPU context made."""
    try:
        from prometheus_client import REGISTRY, Counter, Histogram, core  # noqa: F401
        from prometheus_client.exposition import MetricsHandler  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"--metrics-port needs prometheus-client, which this Python cannot import ({err}): pip "
                           "install prometheus-client (or pip install '.[metrics]' in peerd's clone), or leave "
                           "metrics_port 0") from None


class Metrics:
    def __init__(self, port: int, registry: Registry, arena_usage: Callable[[], list[dict[str, Any]]],
                 devices: list[str]):
        require_prometheus()
        from prometheus_client import REGISTRY, Counter, Histogram
        from prometheus_client.exposition import MetricsHandler

        self._registry = registry
        self.requests = Counter("peerd_requests", "Requests answered, by op and outcome", ["op", "outcome"])
        self.latency = Histogram(
            "peerd_request_seconds", "Time from a request's arrival to its reply (joins include the rendezvous)",
            ["op"], buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30, 60, 120),
        )
        self.joins = Counter("peerd_joins", "Joins answered, by outcome (ok or the error code)", ["outcome"])
        self.agreements = Counter("peerd_agreements", "tp_agree rounds answered by the daemon (the message path; "
                                  "rounds on a control page never reach it), by outcome", ["outcome"])
        REGISTRY.register(_Gauges(registry, arena_usage, devices))
        self.port = port
        self._handler = type("_Handler", (MetricsHandler,), {"registry": REGISTRY})
        self.server: MetricsServer | None = None
        self.unserved: str | None = None  # why the port is not served now, for `peerd status`
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if not self._listen(first=True):
            threading.Thread(target=self._listen_later, name="peerd-metrics-bind", daemon=True).start()

    def _listen(self, first: bool = False) -> bool:
        """Serve on the port, if no other process holds it; False where trying again later may succeed."""
        try:
            server = MetricsServer(self.port, self._handler)
        except PermissionError as err:  # nobody holds it: this user may not bind it, now or later
            why = ("ports below 1024 need root or CAP_NET_BIND_SERVICE, which the daemon's user lacks (the shipped "
                   "unit grants neither): pick a metrics_port of 1024 or more" if self.port < 1024 else
                   "a security policy keeps the daemon's user from binding it: pick another metrics_port")
            self.unserved = f"cannot listen on 127.0.0.1:{self.port} ({err.strerror or err}): {why}"
            log.error("metrics: %s; serving on without metrics", self.unserved)
            return True
        except OSError as err:
            self.unserved = (f"cannot listen on 127.0.0.1:{self.port} ({err.strerror or err}), trying again every "
                             f"{BIND_RETRY_S:g}s: another process holds the port")
            if first:
                log.error("metrics: cannot listen on 127.0.0.1:%d (%s): serving on without metrics and trying the "
                          "port again every %gs; `ss -ltnp 'sport = :%d'` shows who holds it (any local user may "
                          "take a port first: pick another metrics_port, or keep it free for the daemon)",
                          self.port, err.strerror or err, BIND_RETRY_S, self.port)
            return False
        with self._lock:
            if self._closed.is_set():
                server.stop()
                return True
            self.server, self.unserved = server, None
        log.log(logging.INFO if first else logging.WARNING, "metrics on http://127.0.0.1:%d/metrics", self.port)
        return True

    def _listen_later(self) -> None:
        while not self._closed.wait(BIND_RETRY_S) and not self._listen():
            pass

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
        with self._lock:
            self._closed.set()
            server, self.server = self.server, None
        if server is not None:
            server.stop()


class _Gauges:
    """Buffer sets by state, ranks held, bytes by device, arena chunks, rank deaths: read at scrape time.
    Every state and every device served has its series, at 0 when nothing is there: a series that
    vanished would read as its last value (stale) to a dashboard, never as the return to zero."""

    def __init__(self, registry: Registry, arena_usage: Callable[[], list[dict[str, Any]]], devices: list[str]):
        self._registry = registry
        self._arena_usage = arena_usage  # takes the arenas' lock: a scrape waits for at most one allocation
        self._devices = devices  # the identities of the devices the backend serves

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sets = self._registry.all_sets()  # list() copies of dict values: atomic under the GIL
        by_state = GaugeMetricFamily("peerd_buffer_sets", "Buffer sets, by state", labels=["state"])
        counts = dict.fromkeys((state.value for state in State), 0)
        for b in sets:
            counts[b.state.value] = counts.get(b.state.value, 0) + 1
        for state, n in sorted(counts.items()):
            by_state.add_metric([state], n)
        yield by_state
        yield GaugeMetricFamily("peerd_ranks_held", "Ranks holding a buffer set", value=self._registry.ranks_holding())
        by_device = GaugeMetricFamily("peerd_bytes_allocated", "Bytes allocated, by device", labels=["device"])
        for device, n in sorted({**dict.fromkeys(self._devices, 0), **self._registry.bytes_by_device}.items()):
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
