"""SIGHUP's reading of the settings, off the daemon's loop.

A reload reads the configuration file and looks group names up through NSS,
where a directory server may take seconds to answer, or its timeout. On the
loop, that wait would hold every request, every status check and systemd's
watchdog pings behind it (the unit's WatchdogSec kills a daemon silent for
30 s, and with it every buffer it serves), so a thread reads and resolves,
and the loop applies what it read between two messages. SIGHUPs that come
while a reload runs are served by one more reload after it: the file may
have changed since the running one read it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Reloader(Generic[T]):
    """Runs ``read`` on a thread at each ``request``, one run at a time; ``wake`` tells the loop a
    result is waiting in ``finished``."""

    def __init__(self, read: Callable[[], T], wake: Callable[[], None]) -> None:
        self._read, self._wake = read, wake
        self._lock = threading.Lock()
        self._running = self._again = False
        self._done: collections.deque[tuple[T | None, Exception | None]] = collections.deque()

    @property
    def busy(self) -> bool:
        """A read runs or is asked for: what ``finished`` gave is not the last word."""
        with self._lock:
            return self._running

    def request(self) -> bool:
        """Read again; True where a read starts now, False where one runs (another follows it)."""
        with self._lock:
            if self._running:
                self._again = True
                return False
            self._running = True
        threading.Thread(target=self._run, name="peerd-reload", daemon=True).start()
        return True

    def finished(self) -> list[tuple[T | None, Exception | None]]:
        """Each read done since the last call, oldest first: (what it read, None) or (None, its error)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _run(self) -> None:
        while True:
            outcome: tuple[Any, Exception | None]
            try:
                outcome = (self._read(), None)
            except Exception as err:  # a bad file, an unknown group: the loop logs it and keeps what it has
                outcome = (None, err)
            with self._lock:
                self._done.append(outcome)
                again, self._again = self._again, False
                self._running = again
            self._wake()
            if not again:
                return
