"""A lock that a Ctrl-C cannot leave held.

CPython runs signal handlers between bytecodes: right after a call into C
returns, and as a Python function's body begins. A KeyboardInterrupt can
so land just after ``lock.acquire()`` took a plain lock and before the
``try`` that releases it, or at the entry of a Python-level ``__exit__`` or
release helper, before the release; the lock then stays held for the life
of the process (every later call on a worker's daemon connection, or
tp_agree on its page, waits out its deadline). So:

- ``TurnLock.acquire`` undoes its own take where the interrupt lands right
  after it; the caller enters its ``try`` on the next bytecode, with no
  call in between;
- ``release`` is the underlying lock's, a C call: nothing runs before the
  lock is let go. Callers release in a ``finally`` of their own, never
  through a context manager or helper written in Python.

Not reentrant, like ``threading.Lock``: a thread that holds it (a
garbage-collection finalizer on the holder's thread, say) is refused at
once instead of waiting on itself. It is built on an RLock only to know
its owner.
"""

from __future__ import annotations

import threading


class TurnLock:
    """One thread at a time; see the module's note for what it adds to ``threading.Lock``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.release = self._lock.release

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock._is_owned():  # never twice by one thread
            return False
        try:
            return self._lock.acquire(blocking, timeout)
        except BaseException:  # raised right after the take (a Ctrl-C): undone, so nobody waits for it forever
            if self._lock._is_owned():
                self._lock.release()
            raise
