"""Counting what the daemon turns away, with a log that a flood cannot flood.

Each refusal is counted at once (``peerd status`` shows the totals) and
logged in a summary at most once per interval: a client that provokes a
thousand refusals a second costs one log line per cause per interval, not a
thousand.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

LOG_EVERY_S = 10.0


class Allowance:
    """At most ``per_interval`` lines per LOG_EVERY_S: an interval starts at the first line asked
    for after the last one ended."""

    def __init__(self, per_interval: int) -> None:
        self.per_interval = per_interval
        self.ends = 0.0  # when the current interval ends (monotonic)
        self._used = 0

    def take(self, now: float) -> bool:
        """Whether one more line may go out now."""
        if now >= self.ends:
            self._used, self.ends = 0, now + LOG_EVERY_S
        if self._used < self.per_interval:
            self._used += 1
            return True
        return False


class Tally:
    def __init__(self, logger: logging.Logger, what: str, each: int = 0):
        self.total = 0
        self._log = logger
        self._what = what  # e.g. "shut down %d connection(s)"
        self._pending: Counter[str] = Counter()  # cause -> count not yet logged
        self._next_log = 0.0
        self._each = Allowance(each)  # refusals logged on a line of their own per interval; the rest go in the summary

    def add(self, cause: str, detail: str | None = None) -> None:
        """Count one refusal; ``detail``, its own line, is logged at once while fewer than ``each`` were
        this interval (one caller's refusal says who; a thousand are a count by cause)."""
        self.total += 1
        if detail is not None and self._each.take(time.monotonic()):
            self._log.warning("%s", detail)
            return
        self._pending[cause] += 1
        self.flush()

    def due(self) -> float | None:
        """When the next summary is due (a monotonic time), if anything waits to be logged: the loop wakes then."""
        return self._next_log if self._pending else None

    def flush(self) -> None:
        """Log what was counted since the last summary, if one is due."""
        now = time.monotonic()
        if not self._pending or now < self._next_log:
            return
        self._next_log = now + LOG_EVERY_S
        for cause, n in sorted(self._pending.items()):
            self._log.warning(f"{self._what}: %s", n, cause)
        self._pending.clear()
