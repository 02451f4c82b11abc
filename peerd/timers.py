"""Cancellable deadlines, for rules that take the time as an argument.

The registry has no clock: a wait registers ``check(now)`` at its deadline,
the daemon's loop asks when the next one is due and calls ``expire(now)``
then. A wait that ends early cancels its timer, so nothing holds the objects
a finished wait referred to and a busy daemon does not grow.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable

from .outbox import Outbox
from .protocol import DEFAULT_DEADLINE_S

Check = Callable[[float], Outbox]


@dataclass
class Waits:
    """How long a wait lasts when its caller sends no deadline: one object the rendezvous and the
    agreements both read, so a SIGHUP sets each default in one place."""

    rendezvous: float = DEFAULT_DEADLINE_S  # a join, for every rank of its set
    agreement: float = DEFAULT_DEADLINE_S  # a tp_agree round, and a set's commit vote (an agreement among its ranks)


class Timers:
    """A heap of (deadline, timer id); a cancelled timer leaves its entry until it surfaces or a compaction."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._heap: list[tuple[float, int]] = []
        self._checks: dict[int, Check] = {}  # live timers by id

    def at(self, deadline: float, check: Check) -> int:
        """Call check(now) at deadline, unless cancelled first; the timer's id."""
        timer = next(self._ids)
        heapq.heappush(self._heap, (deadline, timer))
        self._checks[timer] = check
        return timer

    def cancel(self, *timers: int) -> None:
        """A wait ended: drop its timers, so nothing holds the objects they refer to."""
        for timer in timers:
            self._checks.pop(timer, None)
        if len(self._heap) > 64 + 2 * len(self._checks):  # mostly cancelled: compact
            self._heap = [entry for entry in self._heap if entry[1] in self._checks]
            heapq.heapify(self._heap)

    def next_deadline(self) -> float | None:
        """When expire() next has work."""
        while self._heap and self._heap[0][1] not in self._checks:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def expire(self, now: float) -> Outbox:
        """Run every check whose deadline has passed; the replies they owe."""
        out: Outbox = []
        while self._heap and self._heap[0][0] <= now:
            _, timer = heapq.heappop(self._heap)
            check = self._checks.pop(timer, None)
            if check is not None:
                out += check(now)
        return out

    def clear(self) -> None:
        self._heap.clear()
        self._checks.clear()
