"""peerd.turnlock: a lock a Ctrl-C cannot leave held, and that no thread takes twice."""

from __future__ import annotations

import threading

import pytest

from peerd.turnlock import TurnLock


class _TakesThenInterrupted:
    """The RLock under a TurnLock, as a Ctrl-C right after a take leaves it: taken, then KeyboardInterrupt."""

    def __init__(self, real):
        self.real = real

    def acquire(self, blocking=True, timeout=-1):
        assert self.real.acquire(blocking, timeout)
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self.real, name)


def _taken_elsewhere(lock: TurnLock, timeout: float = 5) -> bool:
    """Whether another thread takes the lock within ``timeout`` (and lets it go)."""
    got = []

    def take():
        got.append(lock.acquire(timeout=timeout))
        if got[0]:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return got == [True]


def test_an_interrupt_right_after_the_take_leaves_the_lock_free():
    """A plain lock stayed held for good: every later call on the worker's connection waited out its
    deadline, and the release of a closed buffer was never sent."""
    lock = TurnLock()
    lock._lock = _TakesThenInterrupted(lock._lock)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire(timeout=1)
    lock._lock = lock._lock.real
    assert _taken_elsewhere(lock), "another thread takes it at once"


def test_the_holder_is_refused_at_once_instead_of_waiting_on_itself():
    lock = TurnLock()
    assert lock.acquire(timeout=5)
    assert lock.acquire(timeout=30) is False and lock.acquire(blocking=False) is False
    assert not _taken_elsewhere(lock, timeout=0.2), "held by this thread"
    lock.release()
    assert _taken_elsewhere(lock)
