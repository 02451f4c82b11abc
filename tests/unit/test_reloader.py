"""peerd.reloader: SIGHUP's reads run on a thread, one at a time, SIGHUPs meanwhile coalesced into one more."""

from __future__ import annotations

import threading

from peerd.reloader import Reloader


def test_requests_during_a_read_make_one_more_read_and_the_loop_is_woken_for_each():
    gate, reads, wakes = threading.Event(), [], threading.Semaphore(0)

    def read():
        reads.append(len(reads))
        gate.wait(10)
        return len(reads)

    reloader = Reloader(read, wakes.release)
    assert reloader.request() is True
    assert reloader.busy
    assert [reloader.request() for _ in range(3)] == [False, False, False]  # one read runs: one more follows it
    gate.set()
    assert wakes.acquire(timeout=10) and wakes.acquire(timeout=10)
    assert not wakes.acquire(timeout=0.2), "three requests during a read make one more read, not three"
    assert reloader.finished() == [(1, None), (2, None)]
    assert not reloader.busy and reloader.finished() == []


def test_a_failed_read_is_handed_over_as_its_error():
    woken = threading.Event()

    def read():
        raise ValueError("no such group 'x'")

    reloader = Reloader(read, woken.set)
    reloader.request()
    assert woken.wait(10)
    [(value, error)] = reloader.finished()
    assert value is None and isinstance(error, ValueError) and "no such group" in str(error)
    assert reloader.request() is True, "a failed read leaves the reloader ready for the next SIGHUP"
