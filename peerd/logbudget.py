"""A ceiling on the daemon's log lines, so that no client can fill the disk or the journal through it.

What the daemon logs at INFO and WARNING about sets, agreements, pages and
chunks follows what its callers do: a set went live, failed (with the
caller's reason, up to 1 KiB) or was freed. A client that withdraws in a
loop made two lines a request, about 7 MB a second from one connection,
and under journald's rate limit it also pushed out every other line of the
daemon's. So the handler takes at most ``LINES_PER_INTERVAL`` lines of
those loggers (``CALLER_DRIVEN``) per ``LOG_EVERY_S``; the rest are counted
and said in one line once the interval is over (the daemon's loop calls
``flush``, as for its tallies). The daemon's own lines (reloads, limits,
the tallies' summaries of refusals, which bound themselves) always go out,
as do ERROR and above; DEBUG, asked for by whoever runs the daemon, is
never counted.
"""

from __future__ import annotations

import logging
import time

from .tally import LOG_EVERY_S, Allowance

#: INFO and WARNING lines written per interval at most: far above what a node's jobs make
LINES_PER_INTERVAL = 1000
#: the loggers whose lines follow what callers do, one or more a request
CALLER_DRIVEN = frozenset({"peerd.rendezvous", "peerd.agreements", "peerd.pages", "peerd.arena"})


class LogBudget(logging.Filter):
    def __init__(self, per_interval: int = LINES_PER_INTERVAL) -> None:
        super().__init__()
        self._allowance = Allowance(per_interval)
        self._held_back = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.levelno < logging.INFO or record.name not in CALLER_DRIVEN:
            return True
        now = time.monotonic()
        if now >= self._allowance.ends:
            self.flush()  # the interval's count goes out before the next interval's lines
        if self._allowance.take(now):
            return True
        self._held_back += 1
        return False

    def due(self) -> float | None:
        """When the held-back lines are to be counted in the log (the loop wakes then), if any were."""
        return self._allowance.ends if self._held_back else None

    def flush(self) -> None:
        """Say how many lines were held back, once their interval is over."""
        if not self._held_back or time.monotonic() < self._allowance.ends:
            return
        held, self._held_back = self._held_back, 0
        logging.getLogger("peerd").warning(
            "%d log line(s) about sets and agreements not written in %gs: over %d in that time (callers making "
            "the daemon log that much)", held, LOG_EVERY_S, self._allowance.per_interval)


log_budget = LogBudget()  # the daemon's handler's (peerd.cli); its loop flushes it
